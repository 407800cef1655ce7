// Linked with two_tu_b.cpp: an inline variable or function defined in a
// header without `inline` would be a duplicate symbol here.
// Built with gradsync_dep alone, so this also shows that the umbrella header
// builds with no MPI or CUDA on the include path, and the checks below that
// it does not smuggle their declarations in through some other route.
#include <gradsync/gradsync.hpp>

#if defined(MPI_VERSION) || defined(OMPI_MAJOR_VERSION) || defined(MPICH_VERSION)
#error "gradsync/gradsync.hpp pulled in <mpi.h>; only gradsync/backend/mpi.hpp may include it"
#endif

#if defined(NCCL_MAJOR)
#error "gradsync/gradsync.hpp pulled in <nccl.h>; only gradsync/backend/nccl.hpp may include it"
#endif

#if defined(__CUDA_RUNTIME_H__) || defined(CUDART_VERSION) || defined(__CUDACC__)
#error "gradsync/gradsync.hpp pulled in the CUDA runtime; only gradsync/backend/nccl.hpp may include it"
#endif

#include "two_tu_use.hpp"

int a_main() { return use_library<gradsync::Ring>(1.0f); }
