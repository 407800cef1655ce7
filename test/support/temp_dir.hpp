#pragma once
// A fresh directory under the system's temporary one, removed when it goes:
// what the tests that write files work in.

#include <unistd.h>

#include <filesystem>
#include <string>

namespace test {

class TempDir {
 public:
  TempDir() {
    // The process id and a counter: binaries and test cases running at once never share one.
    static int n = 0;
    const std::string name = "gradsync-test-" + std::to_string(::getpid()) + "-" + std::to_string(n++);
    path = std::filesystem::temp_directory_path() / name;
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() { std::filesystem::remove_all(path); }

  std::filesystem::path path;
};

}  // namespace test
