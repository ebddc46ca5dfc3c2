// gtest main for the MPI tests: initialises MPI, prints gtest's report on rank 0 only and every
// failure on the other ranks with the rank in front, and exits non-zero on every rank when a test
// failed on any rank. Tests must reach every collective on every rank (use EXPECT, not ASSERT,
// before a collective), or the job hangs until ctest's timeout.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "parallel/mpi_comm.h"

namespace {

class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  // The name is kept here: UnitTest::current_test_info() would take the lock that gtest holds
  // while it reports a part result.
  void OnTestStart(const ::testing::TestInfo& t) override { test_ = std::string(t.test_suite_name()) + "." + t.name(); }
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::fprintf(stderr, "[rank %d] %s: %s:%d: Failure\n%s\n", rank_, test_.c_str(),
                 r.file_name() ? r.file_name() : "?", r.line_number(), r.message());
    std::fflush(stderr);
  }

 private:
  int rank_;
  std::string test_ = "?";
};

}  // namespace

int main(int argc, char** argv) {
  glm5::parallel::MpiRuntime mpi(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  const int rank = mpi.world_rank(), size = mpi.world_size();
  auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
  if (rank != 0) {
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(rank));
  }
  int failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  int n_failed = 0;
  MPI_CHECK(MPI_Allreduce(&failed, &n_failed, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD));
  if (rank == 0) {
    if (n_failed)
      std::fprintf(stderr, "[mpi] tests failed on %d of %d ranks\n", n_failed, size);
    else
      std::fprintf(stderr, "[mpi] all tests passed on %d ranks\n", size);
  }
  return n_failed ? 1 : 0;
}
