// Throughput of the AVX2 integer instructions behind the int8 kernels (kernels/csrc/quant/), alone and
// in the mixes the int8 panel GEMM could issue, on data in registers: which instructions share the
// vector pipes on this CPU. Built and run by bench/kernels/int8_pipes.py; prints one markdown row a mix.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <vector>

namespace {

constexpr long kIters = 2'000'000;

template <typename F>
double seconds(F f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// 8 dependent scalar adds an iteration: one a cycle, so this gives the core's clock.
void add_chain() {
  for (long i = 0; i < kIters; ++i)
    asm volatile("add $1, %%rax\n add $1, %%rax\n add $1, %%rax\n add $1, %%rax\n"
                 "add $1, %%rax\n add $1, %%rax\n add $1, %%rax\n add $1, %%rax\n" ::: "rax");
}

// Two instructions a and b alternating, 8 in all, each writing its own register from ymm14, ymm15.
#define PAIR(a, b, d0, d1) a " %%ymm14, %%ymm15, %%ymm" #d0 "\n " b " %%ymm14, %%ymm15, %%ymm" #d1 "\n"
#define MIX(name, a, b)                                                                              \
  void name() {                                                                                      \
    for (long i = 0; i < kIters; ++i)                                                                \
      asm volatile(PAIR(a, b, 0, 1) PAIR(a, b, 2, 3) PAIR(a, b, 4, 5) PAIR(a, b, 6, 7) ::: "xmm0", \
                   "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7");                          \
  }
MIX(maddubs, "vpmaddubsw", "vpmaddubsw")
MIX(maddwd, "vpmaddwd", "vpmaddwd")
MIX(sign, "vpsignb", "vpsignb")
MIX(add, "vpaddd", "vpaddd")
MIX(fma, "vfmadd231ps", "vfmadd231ps")
MIX(maddubs_sign, "vpmaddubsw", "vpsignb")
MIX(maddubs_maddwd, "vpmaddubsw", "vpmaddwd")
MIX(maddubs_add, "vpmaddubsw", "vpaddd")
MIX(maddubs_xor, "vpmaddubsw", "vpxor")
MIX(maddubs_fma, "vpmaddubsw", "vfmadd231ps")
MIX(maddwd_fma, "vpmaddwd", "vfmadd231ps")

// One row of x against a panel's two vectors (weights in ymm12-15, ones in ymm11), accumulators
// ymm0-5, x broadcast from memory: 3 rows a quad of inputs, 192 products.
int32_t xbuf[16];   // the nibble split also reads its second half, as the widening multiplier
// the multiplies and adds of a row once x (ymm<x>, and its copy in ymm9) has taken w's sign
#define MULTIPLY_ADD(x, a0, a1)                                                                      \
  "vpmaddubsw %%ymm9, %%ymm14, %%ymm9\n vpmaddubsw %%ymm" #x ", %%ymm15, %%ymm" #x "\n"             \
  "vpmaddwd %%ymm11, %%ymm9, %%ymm9\n vpmaddwd %%ymm11, %%ymm" #x ", %%ymm" #x "\n"                 \
  "vpaddd %%ymm9, %%ymm" #a0 ", %%ymm" #a0 "\n vpaddd %%ymm" #x ", %%ymm" #a1 ", %%ymm" #a1 "\n"
#define SIGN_ROW(off, x, a0, a1)                                                                     \
  "vpbroadcastd " #off "(%0), %%ymm" #x "\n vpsignb %%ymm12, %%ymm" #x ", %%ymm9\n"                \
  "vpsignb %%ymm13, %%ymm" #x ", %%ymm" #x "\n" MULTIPLY_ADD(x, a0, a1)
#define XORSUB_ROW(off, x, a0, a1)                                                                   \
  "vpbroadcastd " #off "(%0), %%ymm" #x "\n vpxor %%ymm12, %%ymm" #x ", %%ymm9\n"                  \
  "vpxor %%ymm13, %%ymm" #x ", %%ymm" #x "\n vpsubb %%ymm12, %%ymm9, %%ymm9\n"                     \
  "vpsubb %%ymm13, %%ymm" #x ", %%ymm" #x "\n" MULTIPLY_ADD(x, a0, a1)
// x rounded to 7 bits and stored as x + 64 (unsigned): vpmaddubsw takes it against w's signed
// bytes as they are (a pair's sum, 2 * 127 * 128, fits int16), no sign instruction
#define X7_ROW(off, x, a0, a1)                                                                       \
  "vpbroadcastd " #off "(%0), %%ymm" #x "\n vpmaddubsw %%ymm12, %%ymm" #x ", %%ymm9\n"            \
  "vpmaddubsw %%ymm13, %%ymm" #x ", %%ymm" #x "\n"                                                 \
  "vpmaddwd %%ymm11, %%ymm9, %%ymm9\n vpmaddwd %%ymm11, %%ymm" #x ", %%ymm" #x "\n"               \
  "vpaddd %%ymm9, %%ymm" #a0 ", %%ymm" #a0 "\n vpaddd %%ymm" #x ", %%ymm" #a1 ", %%ymm" #a1 "\n"
// int16 pairs: a pair of x's int16 broadcast against two vectors of int16 weight pairs (w0, w1)
#define PAIRS_ROW(off, x, w0, w1, a0, a1)                                                            \
  "vpbroadcastd " #off "(%0), %%ymm" #x "\n vpmaddwd %%ymm" #w0 ", %%ymm" #x ", %%ymm9\n"          \
  "vpmaddwd %%ymm" #w1 ", %%ymm" #x ", %%ymm10\n vpaddd %%ymm9, %%ymm" #a0 ", %%ymm" #a0 "\n"      \
  "vpaddd %%ymm10, %%ymm" #a1 ", %%ymm" #a1 "\n"
// nibble split: int8 weights stored as w + 128 in two unsigned nibble vectors per panel vector (h0,
// l0, h1, l1 in ymm12-15) against x's signed bytes, int16 sums over a group's 8 quads (15 * 127 * 2
// * 8 fits), widened once a group (2 vpmaddwd and 2 vpaddd for every 2 quads of 2 rows)
#define NIB_ROW(off, a0, a1, a2, a3)                                                                 \
  "vpbroadcastd " #off "(%0), %%ymm8\n"                                                           \
  "vpmaddubsw %%ymm8, %%ymm12, %%ymm9\n vpaddw %%ymm9, %%ymm" #a0 ", %%ymm" #a0 "\n"             \
  "vpmaddubsw %%ymm8, %%ymm13, %%ymm10\n vpaddw %%ymm10, %%ymm" #a1 ", %%ymm" #a1 "\n"           \
  "vpmaddubsw %%ymm8, %%ymm14, %%ymm11\n vpaddw %%ymm11, %%ymm" #a2 ", %%ymm" #a2 "\n"           \
  "vpmaddubsw %%ymm8, %%ymm15, %%ymm9\n vpaddw %%ymm9, %%ymm" #a3 ", %%ymm" #a3 "\n"
#define CLOBBERS "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10"

void sign_trick() {
  for (long i = 0; i < kIters; ++i)
    asm volatile(SIGN_ROW(0, 6, 0, 1) SIGN_ROW(4, 7, 2, 3) SIGN_ROW(8, 8, 4, 5) ::"r"(xbuf) : CLOBBERS);
}
void xor_sub() {
  for (long i = 0; i < kIters; ++i)
    asm volatile(XORSUB_ROW(0, 6, 0, 1) XORSUB_ROW(4, 7, 2, 3) XORSUB_ROW(8, 8, 4, 5) ::"r"(xbuf) : CLOBBERS);
}
void x7() {
  for (long i = 0; i < kIters; ++i)
    asm volatile(X7_ROW(0, 6, 0, 1) X7_ROW(4, 7, 2, 3) X7_ROW(8, 8, 4, 5) ::"r"(xbuf) : CLOBBERS);
}
void int16_pairs() {
  for (long i = 0; i < kIters; ++i)
    asm volatile(PAIRS_ROW(0, 6, 12, 13, 0, 1) PAIRS_ROW(4, 7, 12, 13, 2, 3) PAIRS_ROW(8, 8, 12, 13, 4, 5)
                 PAIRS_ROW(12, 6, 14, 15, 0, 1) PAIRS_ROW(16, 7, 14, 15, 2, 3) PAIRS_ROW(20, 8, 14, 15, 4, 5)
                 ::"r"(xbuf) : CLOBBERS);
}

void nibble_split() {
  for (long i = 0; i < kIters; ++i)
    asm volatile(NIB_ROW(0, 0, 1, 2, 3) NIB_ROW(4, 4, 5, 6, 7) NIB_ROW(8, 0, 1, 2, 3) NIB_ROW(12, 4, 5, 6, 7)
                 "vpmaddwd 32(%0), %%ymm0, %%ymm10\n vpmaddwd 32(%0), %%ymm5, %%ymm11\n"
                 "vpaddd %%ymm10, %%ymm11, %%ymm10\n vpaddd %%ymm10, %%ymm9, %%ymm9\n"
                 ::"r"(xbuf) : CLOBBERS, "xmm11");
}

struct Case {
  const char* name;
  void (*run)();
  int instructions;   // an iteration's
  int products;       // an iteration's multiply-adds (0: not a kernel mix)
};

}  // namespace

int main() {
  const Case cases[] = {
      {"vpmaddubsw", maddubs, 8, 0}, {"vpmaddwd", maddwd, 8, 0}, {"vpsignb", sign, 8, 0}, {"vpaddd", add, 8, 0},
      {"vfmadd231ps", fma, 8, 0}, {"vpmaddubsw + vpsignb", maddubs_sign, 8, 0},
      {"vpmaddubsw + vpmaddwd", maddubs_maddwd, 8, 0}, {"vpmaddubsw + vpaddd", maddubs_add, 8, 0},
      {"vpmaddubsw + vpxor", maddubs_xor, 8, 0}, {"vpmaddubsw + vfmadd231ps", maddubs_fma, 8, 0},
      {"vpmaddwd + vfmadd231ps", maddwd_fma, 8, 0},
      {"panel, sign trick (3 rows x 2 vectors, a quad)", sign_trick, 27, 192},
      {"panel, sign by xor and sub", xor_sub, 33, 192},
      {"panel, x as 7-bit unsigned (no sign)", x7, 21, 192},
      {"panel, int16 pairs (two pairs)", int16_pairs, 30, 192},
      {"panel, nibble split (2 rows x 2 vectors, 2 quads)", nibble_split, 40, 256}};
  constexpr int kCases = sizeof(cases) / sizeof(cases[0]), kRounds = 9;
  // every round: the clock, then each case in cycles an iteration, by that round's clock
  std::vector<double> cycles[kCases], clocks;
  for (int round = 0; round < kRounds; ++round) {
    const double hz = 8.0 * kIters / seconds(add_chain);
    clocks.push_back(hz / 1e9);
    for (int c = 0; c < kCases; ++c) cycles[c].push_back(seconds(cases[c].run) * hz / kIters);
  }
  std::printf("clock %.2f\n", median(clocks));
  for (int c = 0; c < kCases; ++c) {
    const double per = median(cycles[c]);
    char products[16] = "";
    if (cases[c].products) std::snprintf(products, sizeof products, "%.1f", cases[c].products / per);
    std::printf("| %s | %.2f | %s |\n", cases[c].name, cases[c].instructions / per, products);
  }
}
