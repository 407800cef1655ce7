#pragma once
/// \file save_full_state_dict: a fully_shard model's full state, written by rank 0 as one safetensors file.

#include <cstddef>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include <torch/nn/module.h>

#include "gradsync/checkpoint/safetensors_reader.hpp"
#include "gradsync/checkpoint/tensor_dtype.hpp"
#include "gradsync/checkpoint/tensor_info.hpp"
#include "gradsync/collective/broadcast.hpp"
#include "gradsync/core/communicator.hpp"
#include "gradsync/core/error.hpp"
#include "gradsync/integration/torch/full_state_dict.hpp"

namespace gradsync {

/// Collective over `comm` (and each unit's communicator, as
/// full_state_dict): the full parameters and buffers of `module`, named as
/// the unwrapped module's named_parameters() and named_buffers() name them,
/// written by rank 0 to `path` with gradsync's safetensors writer
/// (atomically, with its checksums), readable by the `safetensors` package
/// and by load_safetensors. Every rank returns once the file is complete,
/// or throws gradsync::Error if rank 0 could not write it.
template <class Holder, Backend B>
void save_full_state_dict(Holder& module, Communicator<B>& comm, const std::filesystem::path& path) {
  const torch::OrderedDict<std::string, at::Tensor> dict = full_state_dict(module);
  std::string failure;
  if (comm.rank() == 0) {
    try {
      std::vector<at::Tensor> keep;
      std::vector<checkpoint::TensorData> tensors;
      for (const auto& item : dict) {
        const at::Tensor t = item.value().contiguous();
        checkpoint::TensorInfo info{item.key(), checkpoint::TensorDtype::F32, {}};
        switch (t.scalar_type()) {
          case c10::ScalarType::Double: info.dtype = checkpoint::TensorDtype::F64; break;
          case c10::ScalarType::Float: info.dtype = checkpoint::TensorDtype::F32; break;
          case c10::ScalarType::BFloat16: info.dtype = checkpoint::TensorDtype::BF16; break;
          case c10::ScalarType::Half: info.dtype = checkpoint::TensorDtype::F16; break;
          case c10::ScalarType::Long: info.dtype = checkpoint::TensorDtype::I64; break;
          case c10::ScalarType::Int: info.dtype = checkpoint::TensorDtype::I32; break;
          case c10::ScalarType::Bool: info.dtype = checkpoint::TensorDtype::BOOL; break;
          default:
            throw InvalidArgument("gradsync: save_full_state_dict: tensor '" + item.key() + "' is " +
                                  c10::toString(t.scalar_type()) + ", which safetensors files here do not hold");
        }
        for (std::int64_t d : t.sizes()) info.shape.push_back(static_cast<std::uint64_t>(d));
        tensors.push_back({info, std::span<const std::byte>(static_cast<const std::byte*>(t.data_ptr()), t.nbytes())});
        keep.push_back(t);
      }
      checkpoint::save_safetensors(path, tensors);
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  // Every rank learns whether the file exists, so none goes on as if it did.
  std::int64_t ok = failure.empty() ? 1 : 0;
  if (comm.size() > 1) Broadcast<Auto>{}(comm, std::span<std::int64_t>(&ok, 1), 0);
  if (!ok) {
    throw Error("gradsync: save_full_state_dict: rank 0 could not write '" + path.string() + "'" +
                (failure.empty() ? std::string() : ": " + failure));
  }
}

}  // namespace gradsync
