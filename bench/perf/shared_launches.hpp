#pragma once
/// \file The collectives' launches, declared extern where bench/meson.build
/// builds a tool beside the tests (GRADSYNC_BENCH_EXTERN_LAUNCHES): the
/// tests' support library compiles each detail::launch<Collective, Algo,
/// Backend> once per build, and the tool links it instead of compiling it
/// again (bench/meson.build says when; docs/CI.md what it saves).
#ifdef GRADSYNC_BENCH_EXTERN_LAUNCHES
#include "support/instances.hpp"
#endif
