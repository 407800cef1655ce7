// The one doctest main every test binary links (test/meson.build builds it
// twice: plain, and with GRADSYNC_TEST_MPI for the suites that run under
// mpirun). `BINARY --helper NAME ARGS...` runs one of the binary's helper
// processes instead (helper_main.hpp).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>

#include "helper_main.hpp"

namespace {

// Several test() entries run one shared binary, each filtered to one source
// file (test/meson.build); a filter that matches no test case (a renamed file,
// a typo) must fail, not pass with nothing run. Queries (--count, --list-*,
// --help) never reach test_run_end and keep doctest's own exit code.
bool ran_no_case = false;

struct NoCaseListener : doctest::IReporter {
  explicit NoCaseListener(const doctest::ContextOptions&) {}
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats& stats) override {
    ran_no_case = stats.numTestCasesPassingFilters == 0;
  }
  void test_case_start(const doctest::TestCaseData&) override {}
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_end(const doctest::CurrentTestCaseStats&) override {}
  void test_case_exception(const doctest::TestCaseException&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData&) override {}
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData&) override {}
};

REGISTER_LISTENER("no_case", 1, NoCaseListener);

int fail_if_no_case(int rc) {
  if (rc == 0 && ran_no_case) {
    std::fprintf(stderr, "no test case matched the filters: failing rather than passing on nothing\n");
    return 1;
  }
  return rc;
}

}  // namespace

#ifdef GRADSYNC_TEST_MPI
#include <mpi.h>

#include "idle_mpi.hpp"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>

// One seed for the whole job (rank 0's), so every process draws the same
// inputs; a failure on any rank fails the job, and each rank prints its own
// summary line.
int main(int argc, char** argv) {
  if (int rc = 0; test::run_helper(argc, argv, rc)) return rc;
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  std::uint64_t seed = 0;
  if (const char* env = std::getenv("GRADSYNC_TEST_SEED")) {
    seed = std::strtoull(env, nullptr, 0);
  } else {
    std::random_device rd;
    seed = (std::uint64_t{rd()} << 32) ^ std::uint64_t{rd()};
  }
  MPI_Bcast(&seed, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  setenv("GRADSYNC_TEST_SEED", std::to_string(seed).c_str(), 1);
  doctest::Context ctx(argc, argv);
  const int rc = fail_if_no_case(ctx.run());
  std::printf("rank %d of %d (mpi): %s, seed %llu\n", rank, size, rc ? "FAILED" : "passed",
              static_cast<unsigned long long>(seed));
  const int worst = test::idle_max(rc);
  MPI_Finalize();
  return worst;
}
#else
int main(int argc, char** argv) {
  if (int rc = 0; test::run_helper(argc, argv, rc)) return rc;
  doctest::Context ctx(argc, argv);
  return fail_if_no_case(ctx.run());
}
#endif
