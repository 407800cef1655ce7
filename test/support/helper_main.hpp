#pragma once
// Helper processes live in the test binaries. Some tests drive a separate
// process that they kill or read back: a checkpoint writer killed before a
// file operation, a rank that kills itself, ranks that leave flight records.
// Each such helper is a function registered here under a name, and compiled
// into the unity binary of its group, where the library code it instantiates
// is compiled already (a helper binary of its own compiled it all again:
// docs/CI.md). support/main.cpp runs
//
//   BINARY --helper NAME ARGS...
//
// as NAME's main with argv {NAME, ARGS...}, before anything else (doctest,
// MPI): a helper sets up what it needs itself.

#include <cstdio>
#include <exception>
#include <functional>
#include <map>
#include <string>
#include <string_view>

namespace test {

using HelperMain = int (*)(int argc, char** argv);

inline std::map<std::string, HelperMain, std::less<>>& helpers() {
  static std::map<std::string, HelperMain, std::less<>> all;
  return all;
}

/// Registers `main` as helper `name`; returns true, for a namespace-scope initializer.
inline bool register_helper(std::string_view name, HelperMain main) {
  helpers().emplace(name, main);
  return true;
}

/// If argv is `BINARY --helper NAME ARGS...`, runs helper NAME and stores its
/// exit code in `rc` (2, with the names, if there is no such helper); returns
/// whether it was a helper call.
inline bool run_helper(int argc, char** argv, int& rc) {
  if (argc < 2 || std::string_view(argv[1]) != "--helper") return false;
  const auto it = argc >= 3 ? helpers().find(std::string_view(argv[2])) : helpers().end();
  if (it == helpers().end()) {
    std::string names;
    for (const auto& [name, main] : helpers()) names += " " + name;
    std::fprintf(stderr, "%s: --helper takes one of:%s\n", argv[0], names.empty() ? " (none here)" : names.c_str());
    rc = 2;
    return true;
  }
  rc = it->second(argc - 2, argv + 2);
  return true;
}

/// `body(argc, argv)`, as helper `name`: an exception it lets out is
/// printed as "name: what" and ends the helper with exit code 1.
inline int main_reporting_exceptions(const char* name, HelperMain body, int argc, char** argv) {
  try {
    return body(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", name, e.what());
    return 1;
  }
}

}  // namespace test

/// `BINARY --helper NAME ...` calls `main_function(argc, argv)`. Once per
/// helper, at the scope of the helper's own namespace (its files share a unity
/// TU with others: each helper's code lives in a namespace named for it).
#define GRADSYNC_TEST_HELPER(NAME, main_function) \
  [[maybe_unused]] static const bool gradsync_test_helper_registered = ::test::register_helper(NAME, main_function)

/// GRADSYNC_TEST_HELPER for a helper that fails by throwing: see
/// main_reporting_exceptions.
#define GRADSYNC_TEST_HELPER_REPORTING_EXCEPTIONS(NAME, main_function)                                   \
  [[maybe_unused]] static const bool gradsync_test_helper_registered = ::test::register_helper(          \
      NAME, [](int argc, char** argv) { return ::test::main_reporting_exceptions(NAME, main_function, argc, argv); })
