#pragma once
/// \file The element types a safetensors file can hold, their names in the
/// header, their sizes, and the gradsync::DataType each corresponds to.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>
#include <type_traits>

#include "gradsync/core/types.hpp"
#include "gradsync/core/visit.hpp"

namespace gradsync::checkpoint {

/// A safetensors dtype. The names are the format's own ("F32", "BF16", …).
enum class TensorDtype : std::uint8_t { F64, F32, F16, BF16, I64, I32, I16, I8, U64, U32, U16, U8, BOOL };

/// The name the header uses for `t`.
constexpr std::string_view dtype_name(TensorDtype t) noexcept {
  switch (t) {
    case TensorDtype::F64: return "F64";
    case TensorDtype::F32: return "F32";
    case TensorDtype::F16: return "F16";
    case TensorDtype::BF16: return "BF16";
    case TensorDtype::I64: return "I64";
    case TensorDtype::I32: return "I32";
    case TensorDtype::I16: return "I16";
    case TensorDtype::I8: return "I8";
    case TensorDtype::U64: return "U64";
    case TensorDtype::U32: return "U32";
    case TensorDtype::U16: return "U16";
    case TensorDtype::U8: return "U8";
    case TensorDtype::BOOL: return "BOOL";
  }
  return "?";
}

/// Bytes per element of `t`.
constexpr std::size_t dtype_size(TensorDtype t) noexcept {
  switch (t) {
    case TensorDtype::F64:
    case TensorDtype::I64:
    case TensorDtype::U64: return 8;
    case TensorDtype::F32:
    case TensorDtype::I32:
    case TensorDtype::U32: return 4;
    case TensorDtype::F16:
    case TensorDtype::BF16:
    case TensorDtype::I16:
    case TensorDtype::U16: return 2;
    case TensorDtype::I8:
    case TensorDtype::U8:
    case TensorDtype::BOOL: return 1;
  }
  return 0;
}

/// The dtype a header names, or nothing for a name gradsync does not know.
constexpr std::optional<TensorDtype> parse_dtype(std::string_view name) noexcept {
  for (int i = 0; i <= static_cast<int>(TensorDtype::BOOL); ++i) {
    auto t = static_cast<TensorDtype>(i);
    if (dtype_name(t) == name) return t;
  }
  return std::nullopt;
}

/// The safetensors dtype that stores a gradsync::DataType.
constexpr TensorDtype to_tensor_dtype(DataType t) noexcept {
  return visit(t, []<class T>(T) {
    if constexpr (std::is_same_v<T, float>) return TensorDtype::F32;
    else if constexpr (std::is_same_v<T, double>) return TensorDtype::F64;
    else if constexpr (std::is_same_v<T, std::int32_t>) return TensorDtype::I32;
    else if constexpr (std::is_same_v<T, std::int64_t>) return TensorDtype::I64;
    else if constexpr (std::is_same_v<T, bfloat16>) return TensorDtype::BF16;
    else {
      static_assert(std::is_same_v<T, float16>, "gradsync: a DataType without a safetensors dtype");
      return TensorDtype::F16;
    }
  });
}

/// The gradsync::DataType a safetensors dtype corresponds to, if there is one.
constexpr std::optional<DataType> to_data_type(TensorDtype t) noexcept {
  switch (t) {
    case TensorDtype::F32: return DataType::float32;
    case TensorDtype::F64: return DataType::float64;
    case TensorDtype::I32: return DataType::int32;
    case TensorDtype::I64: return DataType::int64;
    case TensorDtype::BF16: return DataType::bfloat16;
    case TensorDtype::F16: return DataType::float16;
    default: return std::nullopt;
  }
}

/// The dtype of a C++ element type (gradsync's Element types plus the
/// other fixed-width integers).
template <class T>
inline constexpr TensorDtype tensor_dtype_of = [] {
  if constexpr (Element<T>) return to_tensor_dtype(data_type_v<T>);
  else if constexpr (std::is_same_v<T, std::int16_t>) return TensorDtype::I16;
  else if constexpr (std::is_same_v<T, std::int8_t>) return TensorDtype::I8;
  else if constexpr (std::is_same_v<T, std::uint64_t>) return TensorDtype::U64;
  else if constexpr (std::is_same_v<T, std::uint32_t>) return TensorDtype::U32;
  else if constexpr (std::is_same_v<T, std::uint16_t>) return TensorDtype::U16;
  else if constexpr (std::is_same_v<T, std::uint8_t>) return TensorDtype::U8;
  else if constexpr (std::is_same_v<T, bool>) return TensorDtype::BOOL;
  else static_assert(sizeof(T) == 0, "tensor_dtype_of<T>: T has no safetensors dtype (use float, double, bfloat16, float16 or a fixed-width integer)");
}();

}  // namespace gradsync::checkpoint
