#pragma once
// Helpers for the tests that hand the safetensors reader files built byte by
// byte: raw files from a header and data, and the error a file is refused with.

#include <doctest/doctest.h>

#include <gradsync/checkpoint/safetensors_reader.hpp>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace test_checkpoint_read {

namespace fs = std::filesystem;

/// A file's bytes as a string (safetensors headers are text).
inline std::string file_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

inline void put_text(const fs::path& p, std::string_view bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

/// The 8-byte little-endian length safetensors files start with.
inline std::string length_prefix(std::uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[static_cast<std::size_t>(i)] = static_cast<char>(n >> (8 * i));
  return s;
}

/// A safetensors file: the length prefix (the header's own unless given), the header, `data_bytes` bytes of data.
inline std::string safetensors_bytes(std::string_view header, std::size_t data_bytes,
                                     std::optional<std::uint64_t> length = {}) {
  return length_prefix(length.value_or(header.size())) + std::string(header) + std::string(data_bytes, '\x5a');
}

/// One tensor's header entry, its parts given as JSON text.
inline std::string entry(std::string_view name, std::string_view dtype, std::string_view shape,
                         std::string_view offsets) {
  return "\"" + std::string(name) + "\":{\"dtype\":\"" + std::string(dtype) + "\",\"shape\":" + std::string(shape) +
         ",\"data_offsets\":" + std::string(offsets) + "}";
}

/// What opening `p` throws: a gradsync::Error (anything else fails the test); empty if it opens.
inline std::string open_error(const fs::path& p, bool require_checksums = false) {
  try {
    gradsync::checkpoint::SafetensorsReader r(p, require_checksums);
  } catch (const gradsync::Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    FAIL("opening '" << p.string() << "' threw an exception that is not a gradsync::Error: " << e.what());
  }
  return {};
}

inline bool contains(std::string_view s, std::string_view part) { return s.find(part) != std::string_view::npos; }

}  // namespace test_checkpoint_read
