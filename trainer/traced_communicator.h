#pragma once
// A communicator that records each of its transfers in a Trace while the trace records ([profile]
// steps): the operation in flight, from its start to the moment it was seen complete, on a track
// of the group's own ("comm dp", "comm pp"; transfers in flight together take lanes: "comm dp
// 2", ...) with the bytes this rank sent, and the time the calling thread was blocked waiting
// for it, on that thread's track ("wait all_reduce dp").
// Installed only when a run profiles; otherwise the groups are the plain communicators.
#include <memory>
#include <string>

#include "comm/communicator.h"
#include "trainer/trace.h"

namespace trainer {

std::unique_ptr<Communicator> traced(std::unique_ptr<Communicator> inner, Trace& trace,
                                     const std::string& group);

}  // namespace trainer
