#pragma once
// What each rank of a Threads world said when it refused: the trainer and
// GradSync tests build something every rank must refuse alike, then check
// each rank's message.

#include <gradsync/backend/threads.hpp>
#include <gradsync/core/communicator.hpp>
#include <gradsync/core/error.hpp>

#include <cstddef>
#include <string>
#include <vector>

namespace test {

/// Runs `build(comm)` on each of `world` Threads ranks and returns what each
/// rank's InvalidArgument said, indexed by rank; "" where it threw none. Any
/// other exception is not caught: run_threads passes it on and the test fails.
template <class Build>
std::vector<std::string> refusals_on_threads(int world, gradsync::ThreadsOptions options, Build build) {
  std::vector<std::string> messages(static_cast<std::size_t>(world));
  gradsync::run_threads(world, options, [&](gradsync::Communicator<gradsync::Threads>& comm) {
    try {
      build(comm);
    } catch (const gradsync::InvalidArgument& e) {
      messages[static_cast<std::size_t>(comm.rank())] = e.what();
    }
  });
  return messages;
}

/// The same under run_threads' default options.
template <class Build>
std::vector<std::string> refusals_on_threads(int world, Build build) {
  return refusals_on_threads(world, gradsync::ThreadsOptions{}, build);
}

}  // namespace test
