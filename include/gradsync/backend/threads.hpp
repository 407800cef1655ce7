#pragma once
/// \file The Threads backend: ranks as threads of one process.

#include <chrono>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "gradsync/backend/threads/endpoint.hpp"
#include "gradsync/backend/threads/world.hpp"
#include "gradsync/core/backend_traits.hpp"
#include "gradsync/core/communicator.hpp"
#include "gradsync/core/cost_model.hpp"
#include "gradsync/core/denormals.hpp"
#include "gradsync/core/error.hpp"

namespace gradsync {

/// Backend policy: ranks are threads sharing memory. No setup, no launcher.
struct Threads {
  using Endpoint = detail::threads::Endpoint;

  /// Host memory; Native is the shared-memory direct path, which adds
  /// contributions in rank order; split makes a sub-world of threads.
  static constexpr Capabilities capabilities{
      .native_collectives = true,
      .native_rank_ordered = true,
      .split = true,
  };

  /// Cost-model constants for Auto, in seconds: alpha per message, beta per
  /// byte copied, gamma per byte reduced, native_alpha per synchronisation
  /// and native_beta per byte of the shared-memory path. Fitted by
  /// `all_reduce_perf -t 2 --calibrate` on the 2-core development VM
  /// (2026-11-29, rounded); on another machine run it and export its line as
  /// GRADSYNC_COST_MODEL.
  static constexpr CostModel cost_model{
      .alpha = 0.6e-6,
      .beta = 7.8e-11,
      .gamma = 1.4e-10,
      .native_alpha = 0.13e-6,
      .native_beta = 5.2e-11,
  };
};

/// Options for run_threads.
struct ThreadsOptions {
  /// Deadline for every wait inside a collective (see Communicator::set_timeout).
  std::chrono::nanoseconds timeout = detail::default_timeout;
  /// Flush subnormal floats to zero on every rank's thread (FTZ and DAZ, see
  /// set_flush_denormals): arithmetic on them is 10-100x slower on x86, and
  /// training meets them where a momentum buffer decays geometrically.
  bool flush_denormals = false;
};

namespace detail::threads {

/// A rank's body as run_threads receives it, without its type: the code that
/// starts, watches and joins the ranks is compiled once per program rather
/// than once per lambda (a test file calls run_threads hundreds of times).
/// It refers to the caller's callable, which outlives the call.
class BodyRef {
 public:
  template <class F>
  explicit BodyRef(F& body) noexcept
      : body_(static_cast<const void*>(&body)),
        call_([](const void* b, Communicator<Threads>& comm) { (*static_cast<F*>(const_cast<void*>(b)))(comm); }) {}

  void operator()(Communicator<Threads>& comm) const { call_(body_, comm); }

 private:
  const void* body_;
  void (*call_)(const void*, Communicator<Threads>&);
};

/// run_threads after its checks: see there.
inline void run_ranks(int world_size, const ThreadsOptions& options, BodyRef body) {
  auto world = std::make_shared<World>(world_size);
  std::mutex first_mutex;
  std::exception_ptr first;      // the failure itself
  std::exception_ptr abandoned;  // an Aborted before the world failed: a peer left
  std::exception_ptr reaction;   // an Aborted caused by the failure
  auto rank_main = [&](int r) {
    // The communicator outlives the handler below: its destruction tells
    // waiting peers that this rank left, which must not race ahead of the
    // abort that says why.
    Communicator<Threads> comm(world, r);
    comm.set_timeout(options.timeout);
    // The floating-point control register is per thread; rank 0 runs on the
    // caller's thread, whose setting is put back when the run ends.
    std::optional<FlushDenormals> flush;
    if (options.flush_denormals) flush.emplace();
    try {
      body(comm);
      world->depart(r, Departure::returned);
    } catch (...) {
      world->depart(r, Departure::threw);
      // An Aborted from a rank that was only reacting to the failure must
      // not hide the failure itself.
      std::exception_ptr e = std::current_exception();
      bool secondary = false;
      bool aborted = false;
      try {
        throw;
      } catch (const Aborted&) {
        aborted = true;
        secondary = world->aborted();
      } catch (const std::exception& ex) {
        world->abort(r, RankNames::world(), comm.sequence() + 1, ex.what());
      } catch (...) {
        world->abort(r, RankNames::world(), comm.sequence() + 1, "unknown exception");
      }
      // An Aborted is never the failure itself when there is one: a rank
      // whose body throws destroys its sub-communicators while unwinding,
      // and its peers there may report that before this world is marked.
      std::lock_guard<std::mutex> lock(first_mutex);
      std::exception_ptr& slot = secondary ? reaction : aborted ? abandoned : first;
      if (!slot) slot = e;
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(world_size));
  for (int r = 1; r < world_size; ++r) threads.emplace_back(rank_main, r);
  rank_main(0);
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
  if (abandoned) std::rethrow_exception(abandoned);
  if (reaction) std::rethrow_exception(reaction);
}

}  // namespace detail::threads

/// Runs `body(Communicator<Threads>&)` on `world_size` threads and returns
/// when all are done. If a rank throws, the others' pending and later
/// collectives fail promptly with Aborted, and the first exception is
/// rethrown here. A rank whose body returns while others still call
/// collectives makes those calls fail promptly with Aborted naming it; so
/// does a rank whose sub-communicator (split) is destroyed, by return or by
/// an exception, while its peers there still call it.
template <class F>
void run_threads(int world_size, ThreadsOptions options, F&& body) {
  static_assert(std::is_invocable_v<F&, Communicator<Threads>&>,
                "run_threads: the body must be callable as body(gradsync::Communicator<gradsync::Threads>&)");
  if (world_size < 1) {
    throw InvalidArgument("gradsync: run_threads expects a world size >= 1, got " + std::to_string(world_size));
  }
  if (options.timeout <= options.timeout.zero()) {
    throw InvalidArgument("gradsync: run_threads expects a positive timeout");
  }
  // Through a lambda of its own, so that BodyRef always refers to an object:
  // `body` may also name a function, or overload unary operator&.
  auto call = [&body](Communicator<Threads>& comm) { body(comm); };
  detail::threads::run_ranks(world_size, options, detail::threads::BodyRef(call));
}

template <class F>
void run_threads(int world_size, F&& body) {
  run_threads(world_size, ThreadsOptions{}, std::forward<F>(body));
}

}  // namespace gradsync
