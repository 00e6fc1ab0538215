#include <gtest/gtest.h>

#include "trainer/blas_setup.h"

int main(int argc, char** argv) {
  trainer::ensure_fast_blas(argv);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
