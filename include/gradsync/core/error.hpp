#pragma once
/// \file Exceptions thrown by gradsync; every one derives from gradsync::Error.

#include <cstdint>
#include <exception>
#include <stdexcept>
#include <string>
#include <utility>

namespace gradsync {

/// Base of every error gradsync throws.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Bad arguments, detected before any communication starts.
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

/// A wait ran past the communicator's deadline. The message names the rank,
/// the collective, its sequence number and the peer that never came.
class Timeout : public Error {
 public:
  using Error::Error;
};

/// Another rank failed; this rank's collective was abandoned so it cannot hang.
class Aborted : public Error {
 public:
  using Error::Error;
};

/// The operating system refused a file operation (a checkpoint's save or
/// load): the message names the path, the system's reason and what to do.
class FileError : public Error {
 public:
  FileError(const std::string& what, std::string path, int os_error)
      : Error(what), path_(std::move(path)), os_error_(os_error) {}

  /// The path the operation was refused on.
  const std::string& path() const noexcept { return path_; }
  /// The `errno` value the system gave (ENOSPC, EACCES, ...).
  int os_error() const noexcept { return os_error_; }

 private:
  std::string path_;
  int os_error_ = 0;
};

namespace detail {

/// Which of the classes above a failure was, so that a failure can travel to
/// other ranks (or be remembered by a communicator) and be rethrown there as
/// the same class.
enum class FailureKind : std::uint8_t { error, invalid_argument, timeout, aborted };

/// The kind of the exception being handled; call only inside a catch block.
inline FailureKind current_failure_kind() noexcept {
  try {
    throw;
  } catch (const InvalidArgument&) {
    return FailureKind::invalid_argument;
  } catch (const Timeout&) {
    return FailureKind::timeout;
  } catch (const Aborted&) {
    return FailureKind::aborted;
  } catch (...) {
    return FailureKind::error;
  }
}

/// The text of the exception being handled, or `otherwise` where it is not
/// a std::exception; call only inside a catch block (the text lives as
/// long as the exception it handles).
inline const char* current_exception_what(const char* otherwise) noexcept {
  try {
    throw;
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return otherwise;
  }
}

}  // namespace detail
}  // namespace gradsync
