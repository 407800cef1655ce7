// The unique-id path without a GPU: NCCL 2.28's ncclGetUniqueId needs no
// device (it only picks a bootstrap address), so this runs in CI. Creating
// a communicator from the id needs a GPU and is covered by test_nccl_gpu.

#include <doctest/doctest.h>

#include <nccl.h>

#include <cstring>
#include <string>

#include "gradsync/backend/nccl/error.hpp"

TEST_CASE("ncclGetUniqueId works without a GPU and gives distinct ids") {
  int version = 0;
  REQUIRE(ncclGetVersion(&version) == ncclSuccess);
  MESSAGE("NCCL version code ", version);
  ncclUniqueId a{}, b{};
  const ncclResult_t rc = ncclGetUniqueId(&a);
  if (rc != ncclSuccess) {
    // Some hosts have no usable network interface for NCCL's bootstrap.
    MESSAGE("ncclGetUniqueId failed here: ", gradsync::detail::nccl::nccl_message(rc));
    CHECK_THROWS_AS(gradsync::detail::nccl::check_nccl(rc, "ncclGetUniqueId"), gradsync::Error);
    return;
  }
  REQUIRE(ncclGetUniqueId(&b) == ncclSuccess);
  CHECK(std::memcmp(&a, &b, sizeof a) != 0);
  // The id is a plain 128-byte blob: what a launcher broadcasts.
  static_assert(sizeof(ncclUniqueId) == NCCL_UNIQUE_ID_BYTES);
}

TEST_CASE("NCCL errors become gradsync::Error with NCCL's words") {
  try {
    gradsync::detail::nccl::check_nccl(ncclInvalidArgument, "ncclSomething");
    FAIL("no throw");
  } catch (const gradsync::Error& e) {
    const std::string what = e.what();
    CHECK(what.find("ncclSomething") != std::string::npos);
    CHECK(what.find("invalid argument") != std::string::npos);
  }
}
