#pragma once
// The model of examples/libtorch_fsdp.cpp: a decoder-only, character-level
// transformer (GPT-style, pre-norm) from LibTorch's own layers. Its blocks
// are declared as gradsync::ShardedModule<Block>, so that fully_shard can
// make each one a unit and the root's call runs each block between the
// unit's gather and free; before fully_shard they behave as plain blocks.
// Attention is built from two Linear layers with a causal mask rather than
// torch::nn::MultiheadAttention, whose forward also computes the averaged
// attention weights by default: the example needs neither them nor a
// key-padding mask.

#include <gradsync/integration/torch.hpp>

#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace example {

/// Sizes of a CharTransformer.
struct TransformerShape {
  std::int64_t vocab = 0, context = 64, d_model = 128, heads = 4, blocks = 4;
};

/// One pre-norm block: x + attention(ln1(x)), then x + mlp(ln2(x)), the
/// MLP 4·d_model wide with GELU.
struct BlockImpl : torch::nn::Module {
  BlockImpl(std::int64_t d_model, std::int64_t heads)
      : heads_(heads),
        ln1(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})))),
        qkv(register_module("qkv", torch::nn::Linear(d_model, 3 * d_model))),
        proj(register_module("proj", torch::nn::Linear(d_model, d_model))),
        ln2(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})))),
        up(register_module("up", torch::nn::Linear(d_model, 4 * d_model))),
        down(register_module("down", torch::nn::Linear(4 * d_model, d_model))) {}

  /// x: batch x time x d_model; position t attends to positions 0..t only.
  torch::Tensor forward(torch::Tensor x) {
    const std::int64_t b = x.size(0), t = x.size(1), c = x.size(2), hd = c / heads_;
    // batch x time x (q, k, v) x heads x hd  ->  (q, k, v) x batch x heads x time x hd
    const torch::Tensor qkv_ = qkv(ln1(x)).view({b, t, 3, heads_, hd}).permute({2, 0, 3, 1, 4});
    const torch::Tensor q = qkv_[0], k = qkv_[1], v = qkv_[2];
    const torch::Tensor future = torch::ones({t, t}, torch::kBool).triu(1);
    const torch::Tensor weights = (torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(hd)))
                                      .masked_fill(future, -std::numeric_limits<float>::infinity())
                                      .softmax(-1);
    x = x + proj(torch::matmul(weights, v).transpose(1, 2).reshape({b, t, c}));
    return x + down(torch::gelu(up(ln2(x))));
  }

  std::int64_t heads_;
  torch::nn::LayerNorm ln1;
  torch::nn::Linear qkv, proj;
  torch::nn::LayerNorm ln2;
  torch::nn::Linear up, down;
};
TORCH_MODULE(Block);

/// Token and position embeddings, the blocks, a final LayerNorm and a
/// linear head to the vocabulary's logits. The root's own parameters
/// (embeddings, final norm, head) become the root's unit.
struct CharTransformerImpl : torch::nn::Module {
  explicit CharTransformerImpl(const TransformerShape& s)
      : tok(register_module("tok", torch::nn::Embedding(s.vocab, s.d_model))),
        pos(register_module("pos", torch::nn::Embedding(s.context, s.d_model))),
        ln_f(register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({s.d_model})))),
        head(register_module("head", torch::nn::Linear(s.d_model, s.vocab))) {
    for (std::int64_t i = 0; i < s.blocks; ++i) {
      blocks.emplace_back(register_module("block" + std::to_string(i), Block(s.d_model, s.heads)));
    }
  }

  /// idx: batch x time character ids (time at most the context): the
  /// logits, batch x time x vocab, of each next character.
  torch::Tensor forward(const torch::Tensor& idx) {
    torch::Tensor x = tok(idx) + pos(torch::arange(idx.size(1), torch::kLong));
    for (auto& block : blocks) x = block(x);  // ShardedModule's call: gathers, runs, frees
    return head(ln_f(x));
  }

  torch::nn::Embedding tok, pos;
  torch::nn::LayerNorm ln_f;
  torch::nn::Linear head;
  std::vector<gradsync::ShardedModule<Block>> blocks;
};
TORCH_MODULE(CharTransformer);

}  // namespace example
