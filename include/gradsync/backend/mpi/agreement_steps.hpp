#pragma once
/// \file The schedule of the Mpi call agreement when it goes by messages:
/// recursive doubling, written out step by step (see Control).

#include <vector>

namespace gradsync::detail::mpi {

/// One step of a rank's part in the agreement: send the value so far to
/// `to`, then and in what `from` sends (-1: no such half).
struct AgreementStep {
  int to = -1;
  int from = -1;
  int tag = 0;
};

/// The agreement's own tags, apart from the notices' (1, probed from any
/// source): a pair that folds, its unfold, then round j.
inline constexpr int agreement_fold_tag = 2;
inline constexpr int agreement_unfold_tag = 3;
inline constexpr int agreement_round_tag = 4;

/// Rank r's steps in a recursive-doubling all-reduce over p ranks. For p
/// not a power of two, the first 2(p - p') ranks (p' the largest power of
/// two <= p) pair up: the even one hands its value to the odd one, which
/// stands for both in the rounds, then hands the result back.
inline std::vector<AgreementStep> agreement_steps(int r, int p) {
  int pow2 = 1;
  while (pow2 * 2 <= p) pow2 *= 2;
  const int extra = p - pow2;
  std::vector<AgreementStep> steps;
  if (r < 2 * extra && r % 2 == 0) {
    steps.push_back({r + 1, -1, agreement_fold_tag});
    steps.push_back({-1, r + 1, agreement_unfold_tag});
    return steps;
  }
  const bool folds = r < 2 * extra;
  if (folds) steps.push_back({-1, r - 1, agreement_fold_tag});
  const int v = folds ? r / 2 : r - extra;
  for (int d = 1, j = 0; d < pow2; d *= 2, ++j) {
    const int w = v ^ d;
    const int q = w < extra ? 2 * w + 1 : w + extra;
    steps.push_back({q, q, agreement_round_tag + j});
  }
  if (folds) steps.push_back({r - 1, -1, agreement_unfold_tag});
  return steps;
}

}  // namespace gradsync::detail::mpi
