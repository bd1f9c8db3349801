// kaiten_cpu::lora_add_: batched LoRA in place, y += x A_s B_s for each adapter token, fp32.
//
// The step's adapter tokens come sorted by slot (engine_worker/model/lora_layers.py's LoraBatch,
// segmented layout): token_index [N] their rows of x and y, bounds [S + 1] each slot's run. A slot
// holds A [in, parts * R] and B [R, out]; part i of a fused projection (q, k, v or gate, up) owns
// rank columns i*R..(i+1)*R of x A and its `splits[i]` columns of B and y.
//
// Shrink: h = x A_s over tiles of a slot's tokens, A's rows streamed once per tile. Expand: per
// slot, part and block of output columns, y's rows loaded, R rank-one updates from B's rows, and
// stored back; each block of B is read once per tile of tokens from L1. Threads split the tiles
// of the shrink and the column blocks of the expand. One source for AVX-512, AVX2 and portable
// code through at::vec, as in the other kernels.
#include "aten_ops.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int VL = Vec::size();
constexpr int kTile = 4;      // tokens per tile
constexpr int kVecs = 3;      // vectors of columns per block (kTile * kVecs accumulators)
#define UNROLL _Pragma("GCC unroll 16")

struct Lora {
  const float* x;
  float* y;
  const float* a;
  const float* b;
  const int64_t* rows;
  float* h;
  int64_t x_stride, y_stride, in, w, rank, out;
};

struct Run {
  int64_t slot, lo, hi;       // token_index[lo:hi] use slot
};

inline Vec load(const float* p, int64_t n) { return n >= VL ? Vec::loadu(p) : Vec::loadu(p, n); }
inline void store(const Vec& v, float* p, int64_t n) { n >= VL ? v.store(p) : v.store(p, n); }

// The kVecs vectors of a row from p (left columns remain: the tail masked, past it zeros), and back.
inline void load_row(Vec (&row)[kVecs], const float* p, int64_t left) {
  UNROLL
  for (int v = 0; v < kVecs; ++v) row[v] = v * VL < left ? load(p + v * VL, left - v * VL) : Vec(0.f);
}
inline void store_row(const Vec (&row)[kVecs], float* p, int64_t left) {
  UNROLL
  for (int v = 0; v < kVecs; ++v)
    if (v * VL < left) store(row[v], p + v * VL, left - v * VL);
}

// acc[t] += sum over k < depth of s[t][k] m[k, 0:left] (m's rows ld apart): both halves' core, the
// shrink over A's rows (s: the tokens' x rows), the expand over B's rows (s: their h columns).
template <int NT>
inline void rank_one_updates(Vec (&acc)[NT][kVecs], const float* const* s, const float* m, int64_t ld,
                             int64_t depth, int64_t left) {
  for (int64_t k = 0; k < depth; ++k, m += ld) {
    Vec mv[kVecs];
    load_row(mv, m, left);
    UNROLL
    for (int t = 0; t < NT; ++t) {
      const Vec sv(s[t][k]);
      UNROLL
      for (int v = 0; v < kVecs; ++v) acc[t][v] = at::vec::fmadd(sv, mv[v], acc[t][v]);
    }
  }
}

// h[t, c:c + kVecs * VL] = x[rows[t]] A_s[:, c:...] for the tokens t0..t0+NT of one slot.
template <int NT>
void shrink_block(const Lora& L, int64_t slot, int64_t t0, int64_t c) {
  const int64_t left = L.w - c;
  Vec acc[NT][kVecs];
  const float* xs[NT];
  UNROLL
  for (int t = 0; t < NT; ++t) {
    UNROLL
    for (int v = 0; v < kVecs; ++v) acc[t][v] = Vec(0.f);
    xs[t] = L.x + L.rows[t0 + t] * L.x_stride;
  }
  rank_one_updates<NT>(acc, xs, L.a + slot * L.in * L.w + c, L.w, L.in, left);
  UNROLL
  for (int t = 0; t < NT; ++t) store_row(acc[t], L.h + (t0 + t) * L.w + c, left);
}

// y[rows[t], c:c + kVecs * VL] += h[t, part's rank columns] B_s[:, c:...] for tokens t0..t0+NT.
template <int NT>
void expand_block(const Lora& L, int64_t slot, int64_t t0, int64_t h_col, int64_t c, int64_t end) {
  const int64_t left = end - c;
  Vec acc[NT][kVecs];
  float* ys[NT];
  const float* hs[NT];
  UNROLL
  for (int t = 0; t < NT; ++t) {
    ys[t] = L.y + L.rows[t0 + t] * L.y_stride + c;
    hs[t] = L.h + (t0 + t) * L.w + h_col;
    load_row(acc[t], ys[t], left);
  }
  rank_one_updates<NT>(acc, hs, L.b + slot * L.rank * L.out + c, L.out, L.rank, left);
  UNROLL
  for (int t = 0; t < NT; ++t) store_row(acc[t], ys[t], left);
}

// Calls Kernel<NT>::call(t0, args...) over a run's tokens in tiles of kTile, the tail in one call.
template <template <int> class Kernel, typename... Args>
void over_tiles(const Run& run, Args... args) {
  int64_t t = run.lo;
  for (; t + kTile <= run.hi; t += kTile) Kernel<kTile>::call(t, args...);
  switch (run.hi - t) {
    case 3: Kernel<3>::call(t, args...); break;
    case 2: Kernel<2>::call(t, args...); break;
    case 1: Kernel<1>::call(t, args...); break;
    default: break;
  }
}

template <int NT>
struct Shrink {
  static void call(int64_t t0, const Lora& L, int64_t slot, int64_t c) { shrink_block<NT>(L, slot, t0, c); }
};

template <int NT>
struct Expand {
  static void call(int64_t t0, const Lora& L, int64_t slot, int64_t h_col, int64_t c, int64_t end) {
    expand_block<NT>(L, slot, t0, h_col, c, end);
  }
};

void lora_add_(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, at::IntArrayRef splits,
               const at::Tensor& token_index, const at::Tensor& bounds) {
  const int64_t n = token_index.numel();
  if (n == 0) return;
  TORCH_CHECK(x.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat && a.scalar_type() == at::kFloat &&
              b.scalar_type() == at::kFloat, "lora_add_: fp32 only");
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous() && a.dim() == 3 && b.dim() == 3, "lora_add_: a, b must be "
              "contiguous [S, in, parts * R] and [S, R, out]");
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.stride(1) == 1 && y.stride(1) == 1, "lora_add_: x, y must be "
              "row-major matrices");
  const int64_t parts = static_cast<int64_t>(splits.size());
  TORCH_CHECK(parts > 0 && a.size(2) == parts * b.size(1) && x.size(1) == a.size(1) && y.size(1) == b.size(2),
              "lora_add_: shapes of x, y, a, b and splits disagree");
  const at::Tensor idx = token_index.to(at::kLong).contiguous();
  const at::Tensor edges = bounds.to(at::kLong).contiguous();
  at::Tensor h = at::empty({n, a.size(2)}, x.options());
  const Lora L{x.data_ptr<float>(), y.data_ptr<float>(), a.data_ptr<float>(), b.data_ptr<float>(),
               idx.data_ptr<int64_t>(), h.data_ptr<float>(), x.stride(0), y.stride(0), a.size(1), a.size(2),
               b.size(1), b.size(2)};
  std::vector<Run> runs;
  const int64_t* e = edges.data_ptr<int64_t>();
  for (int64_t s = 0; s + 1 < edges.numel(); ++s)
    if (e[s + 1] > e[s]) runs.push_back({s, e[s], e[s + 1]});
  TORCH_CHECK(!runs.empty() && runs.back().hi == n, "lora_add_: bounds do not cover token_index");
  // Expand work items: (run, part, column block) of the fused output.
  constexpr int64_t block = kVecs * VL;
  std::vector<int64_t> part_start(parts + 1, 0), part_blocks(parts + 1, 0);
  for (int64_t p = 0; p < parts; ++p) {
    part_start[p + 1] = part_start[p] + splits[p];
    part_blocks[p + 1] = part_blocks[p] + (splits[p] + block - 1) / block;
  }
  TORCH_CHECK(part_start[parts] == L.out, "lora_add_: splits do not add up to y's columns");

  const int64_t w_blocks = (L.w + block - 1) / block;
  at::parallel_for(0, static_cast<int64_t>(runs.size()) * w_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Run& run = runs[i / w_blocks];
      over_tiles<Shrink>(run, L, run.slot, (i % w_blocks) * block);
    }
  });
  const int64_t per_run = part_blocks[parts];
  at::parallel_for(0, static_cast<int64_t>(runs.size()) * per_run, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Run& run = runs[i / per_run];
      const int64_t j = i % per_run;
      const int64_t p = std::upper_bound(part_blocks.begin(), part_blocks.end(), j) - part_blocks.begin() - 1;
      const int64_t c = part_start[p] + (j - part_blocks[p]) * block;
      over_tiles<Expand>(run, L, run.slot, p * L.rank, c, part_start[p + 1]);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kaiten_cpu, m) {
  m.def("lora_add_(Tensor(a!) y, Tensor x, Tensor a, Tensor b, int[] splits, Tensor token_index, "
        "Tensor bounds) -> ()");
}

TORCH_LIBRARY_IMPL(kaiten_cpu, CPU, m) { m.impl("lora_add_", &lora_add_); }
