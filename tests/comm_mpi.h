#pragma once
// What the tests under a real `mpirun -np 4` share (tests/CMakeLists.txt: comm_mpi_tests, whose
// main is comm_mpi_main.cpp): every rank runs every test, and a failure on any rank fails the job.
#include <memory>
#include <vector>

#include "comm/communicator.h"

namespace trainer {

inline World* g_world = nullptr;  // the process's MPI world, owned by main()

inline DPtr ptr(std::vector<float>& v) {
  return {reinterpret_cast<std::byte*>(v.data()), DType::f32};
}
inline DPtr ptr(std::vector<double>& v) {
  return {reinterpret_cast<std::byte*>(v.data()), DType::f64};
}

// Four ranks as two "nodes" of two: intra 0 1 | 2 3, inter (the ranks at the same place on
// each node) 0 2 | 1 3.
struct TwoNodes {
  std::unique_ptr<Communicator> intra, inter;
};
inline TwoNodes two_nodes(World& w) {
  const int r = w.comm().rank();
  return {w.group(r < 2 ? std::vector<int>{0, 1} : std::vector<int>{2, 3}),
          w.group(r % 2 == 0 ? std::vector<int>{0, 2} : std::vector<int>{1, 3})};
}

}  // namespace trainer
