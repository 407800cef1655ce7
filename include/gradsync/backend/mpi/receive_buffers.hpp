#pragma once
/// \file ReceiveBuffers: where an Mpi endpoint receives what it reduces
/// (a receive cannot reduce into the destination as it lands). Pooled, and
/// each only grows, so a steady state allocates nothing.

#include <cstddef>
#include <memory>
#include <vector>

namespace gradsync::detail::mpi {

class ReceiveBuffers {
 public:
  /// A free buffer of at least `bytes`, marked busy: its index.
  std::size_t take(std::size_t bytes) {
    for (std::size_t i = 0; i < buffers_.size(); ++i) {
      if (!buffers_[i].busy && buffers_[i].bytes >= bytes) {
        buffers_[i].busy = true;
        return i;
      }
    }
    for (std::size_t i = 0; i < buffers_.size(); ++i) {
      if (!buffers_[i].busy) {
        buffers_[i].data = std::make_unique<std::byte[]>(bytes);
        buffers_[i].bytes = bytes;
        buffers_[i].busy = true;
        return i;
      }
    }
    buffers_.push_back(Buffer{std::make_unique<std::byte[]>(bytes ? bytes : 1), bytes, true});
    return buffers_.size() - 1;
  }
  std::byte* data(std::size_t i) const noexcept { return buffers_[i].data.get(); }
  void release(std::size_t i) noexcept { buffers_[i].busy = false; }
  /// After a call's receives are taken back: none is in use.
  void release_all() noexcept {
    for (auto& b : buffers_) b.busy = false;
  }
  void swap(ReceiveBuffers& o) noexcept { buffers_.swap(o.buffers_); }

 private:
  struct Buffer {
    std::unique_ptr<std::byte[]> data;
    std::size_t bytes = 0;
    bool busy = false;
  };
  std::vector<Buffer> buffers_;
};

}  // namespace gradsync::detail::mpi
