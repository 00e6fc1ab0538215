// comm_mpi_tests' main: gtest on every rank of the MPI world (comm_mpi.h).
#include <gtest/gtest.h>

#include <cstdlib>

#include "comm_mpi.h"

int main(int argc, char** argv) {
  auto world = trainer::make_mpi_world(&argc, &argv);
  trainer::g_world = world.get();
  ::testing::InitGoogleTest(&argc, argv);
  // One rank prints (TRAINER_TEST_ALL_RANKS=1: every rank); every rank's result counts.
  if (world->rank() != 0 && !std::getenv("TRAINER_TEST_ALL_RANKS")) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  return RUN_ALL_TESTS();  // mpirun exits non-zero when any rank does
}
