// Adding data parallelism to an existing training loop with gradsync::GradSync.
//
// The loop below is a plain softmax-regression trainer with its weights and
// gradients in its own std::vectors. The lines marked "gradsync" are all it
// takes to run it on 4 ranks: register the gradients once, report each one
// ready as backward produces it, and call finish() before the update.

// First: its pragma reaches the intrinsics header only if nothing included it before.
#include "eigen_dense.hpp"

#include <gradsync/gradsync.hpp>

#include <cmath>
#include <cstdio>
#include <random>
#include <span>
#include <vector>

int main(int argc, char** argv) {
  if (argc > 1) {
    std::fprintf(stderr, "usage: %s (it takes no options; got %s)\n", argv[0], argv[1]);
    return 2;
  }
  constexpr int ranks = 4, dim = 32, classes = 4, per_rank = 2000, batch = 50, epochs = 10;
  gradsync::run_threads(ranks, [&](gradsync::Communicator<gradsync::Threads>& comm) {
    // Each rank's own data: points around one centre per class.
    std::mt19937 rng(1 + comm.rank());
    std::normal_distribution<float> normal;
    std::mt19937 shared(42);
    Eigen::MatrixXf centres = Eigen::MatrixXf::NullaryExpr(dim, classes, [&] { return 0.5f * normal(shared); });
    Eigen::MatrixXf x(dim, per_rank);
    std::vector<int> y(per_rank);
    for (int i = 0; i < per_rank; ++i) {
      y[i] = static_cast<int>(rng() % classes);
      for (int j = 0; j < dim; ++j) x(j, i) = centres(j, y[i]) + normal(rng);
    }

    // The existing model: weights, bias and their gradients, each its own vector.
    std::vector<float> w(classes * dim, 0.0f), b(classes, 0.0f), gw(w.size()), gb(b.size());

    // gradsync: average gw and gb across ranks (in forward order: w, then b).
    gradsync::GradSync<gradsync::Threads, float> sync(comm, {std::span<float>(gw), std::span<float>(gb)});
    // gradsync: every rank starts from rank 0's weights.
    gradsync::Broadcast<>{}(comm, w, 0);

    for (int epoch = 0; epoch < epochs; ++epoch) {
      double loss = 0;
      for (int at = 0; at < per_rank; at += batch) {
        Eigen::Map<Eigen::MatrixXf> W(w.data(), classes, dim), GW(gw.data(), classes, dim);
        Eigen::Map<Eigen::VectorXf> B(b.data(), classes), GB(gb.data(), classes);
        Eigen::MatrixXf p = (W * x.middleCols(at, batch)).colwise() + B;
        for (int i = 0; i < batch; ++i) {
          p.col(i) = (p.col(i).array() - p.col(i).maxCoeff()).exp().matrix();
          p.col(i) /= p.col(i).sum();
          loss -= std::log(p(y[at + i], i));
          p(y[at + i], i) -= 1.0f;
        }
        p /= float(batch);
        GB = p.rowwise().sum();
        sync.ready(1);  // gradsync: the bias gradient is final
        GW = p * x.middleCols(at, batch).transpose();
        sync.ready(0);  // gradsync: so is the weight gradient
        sync.finish();  // gradsync: gw and gb now hold the mean over ranks
        W -= 0.5f * GW;
        B -= 0.5f * GB;
      }
      // gradsync: the mean loss over all ranks, for the log.
      double sums[1] = {loss / per_rank};
      gradsync::AllReduce<>{}(comm, std::span<double>(sums), gradsync::Avg{});
      if (comm.rank() == 0) std::printf("epoch %2d  loss %.4f\n", epoch + 1, sums[0]);
    }
  });
}
