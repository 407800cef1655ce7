#pragma once
/// \file Exceptions thrown by gradsync; every one derives from gradsync::Error.

#include <stdexcept>
#include <string>

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

}  // namespace gradsync
