#pragma once
/// \file Initialises MPI for programs that did not.

#include <mpi.h>

#include <string>

#include "gradsync/core/error.hpp"

namespace gradsync::detail::mpi {

/// Calls MPI_Init_thread on first use if nobody has, and MPI_Finalize at
/// exit if (and only if) it was the one that initialised. A program that
/// manages MPI itself is left alone.
class Environment {
 public:
  static void ensure() { static Environment env; }

  Environment(const Environment&) = delete;
  Environment& operator=(const Environment&) = delete;

  ~Environment() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (owned_ && !finalized) MPI_Finalize();
  }

 private:
  Environment() {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (initialized) return;
    int provided = 0;
    // Serialized is enough: a communicator is used by one thread at a time,
    // though not always the same one (trainers hand it to a worker).
    if (MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided) != MPI_SUCCESS) {
      throw Error("gradsync: MPI_Init_thread failed");
    }
    owned_ = true;
    if (provided < MPI_THREAD_SERIALIZED) {
      throw Error("gradsync: MPI provides thread level " + std::to_string(provided) +
                  ", gradsync needs MPI_THREAD_SERIALIZED");
    }
  }
  bool owned_ = false;
};

}  // namespace gradsync::detail::mpi
