#pragma once
/// \file detail::fsdp::Offloaded: elements allocated in an offload space and
/// returned to it when they go; the master and gradient shards and the
/// optimizer's state live in one under ShardedTrainerOptions::offload.

#include <cstddef>
#include <memory>
#include <span>
#include <utility>

#include "gradsync/core/offload_space.hpp"

namespace gradsync::detail::fsdp {

/// n elements of T in an offload space, returned to it when this goes.
template <class T>
class Offloaded {
 public:
  Offloaded() = default;
  Offloaded(std::shared_ptr<OffloadSpace> space, std::size_t n)
      : space_(std::move(space)), data_(static_cast<T*>(space_->allocate(n * sizeof(T)))), n_(n) {}
  Offloaded(const Offloaded&) = delete;
  Offloaded& operator=(Offloaded&& o) noexcept {
    std::swap(space_, o.space_);
    std::swap(data_, o.data_);
    std::swap(n_, o.n_);
    return *this;
  }
  ~Offloaded() {
    if (data_ != nullptr) space_->deallocate(data_, n_ * sizeof(T));
  }
  std::span<T> span() const noexcept { return {data_, n_}; }

 private:
  std::shared_ptr<OffloadSpace> space_;
  T* data_ = nullptr;
  std::size_t n_ = 0;
};

}  // namespace gradsync::detail::fsdp
