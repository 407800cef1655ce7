#pragma once
// What every rank must have seen when ranks declared different units: the
// same InvalidArgument, naming the first unit and the odd rank, and no
// trainer built. Shared by the GradSync, ReplicatedTrainer and ShardedTrainer
// tests (the last on Threads and under mpirun).

#include <doctest/doctest.h>

#include <gradsync/core/error.hpp>

#include <cstddef>
#include <exception>
#include <string>
#include <vector>

namespace test {

/// Runs `build` (which constructs what must refuse); what it throws lands in
/// `message`, marked when it is not an InvalidArgument.
template <class Build>
void catch_message(std::string& message, Build build) {
  try {
    build();
  } catch (const gradsync::InvalidArgument& e) {
    message = e.what();
  } catch (const std::exception& e) {
    message = std::string("not an InvalidArgument: ") + e.what();
  }
}

inline void check_unit_disagreement(const std::string& who, const std::vector<std::string>& messages,
                                    const std::vector<int>& constructed, int unit, int odd) {
  const std::string& m = messages[0];
  INFO(m);
  CHECK(m.find("gradsync: " + who + ": ranks declared different units: ") == 0);
  const std::string u = std::to_string(unit);
  CHECK((m.find("declared unit " + u + " as ") != std::string::npos ||
         m.find("declared no unit " + u + " (") != std::string::npos));
  CHECK(m.find("rank " + std::to_string(odd) + " declared") != std::string::npos);
  for (std::size_t r = 0; r < messages.size(); ++r) {
    CAPTURE(r);
    CHECK(constructed[r] == 0);
    CHECK(messages[r] == m);
  }
}

}  // namespace test
