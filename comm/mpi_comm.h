#pragma once
// The MPI communicator behind a Communicator of the MPI world, for libraries that speak MPI
// themselves (parallel HDF5). Throws std::logic_error for any other kind.
#include <mpi.h>

#include "comm/communicator.h"

namespace trainer {

MPI_Comm mpi_comm_of(Communicator& comm);

}  // namespace trainer
