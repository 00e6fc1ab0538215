#include "trainer/report_error.h"

#include <fmt/format.h>

#include <filesystem>
#include <new>

#include "io/errors.h"
#include "trainer/loss_scaler.h"

namespace trainer {

int report_error(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const InputError& e) {
    fmt::print(stderr, "trainer: {} error: {}\n", e.category(), e.what());
    return kExitBadInput;
  } catch (const std::filesystem::filesystem_error& e) {
    fmt::print(stderr, "trainer: file error: {}\n", e.what());
    return kExitBadInput;
  } catch (const std::bad_alloc&) {
    fmt::print(stderr,
               "trainer: out of memory: the model, batch and optimizer state do not fit "
               "(reduce train.micro_batch, model.seq_len or the model size)\n");
    return kExitBadInput;
  } catch (const TrainingDiverged& e) {
    fmt::print(stderr, "trainer: training diverged: {}\n", e.what());
    return kExitDiverged;
  } catch (const std::exception& e) {  // a bug, not bad input: still one line, no abort
    fmt::print(stderr, "trainer: internal error: {}\n", e.what());
    return 1;
  } catch (...) {
    fmt::print(stderr, "trainer: internal error: unknown exception\n");
    return 1;
  }
}

}  // namespace trainer
