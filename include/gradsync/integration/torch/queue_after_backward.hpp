#pragma once
/// \file detail::queue_after_backward: a member function of an object run
/// once the current backward has ended.

#include <memory>

#include <torch/csrc/autograd/engine.h>

namespace gradsync::detail {

/// Has the autograd engine call `(object.*member)()` after the whole
/// current backward, before backward() returns; an exception it throws
/// reaches backward()'s caller. The callback holds `object` weakly (T
/// derives from std::enable_shared_from_this<T>): an object destroyed by
/// then is not called.
template <class T>
void queue_after_backward(T& object, void (T::*member)()) {
  std::weak_ptr<T> weak = object.weak_from_this();
  torch::autograd::Engine::get_default_engine().queue_callback([weak, member] {
    if (auto o = weak.lock()) ((*o).*member)();
  });
}

}  // namespace gradsync::detail
