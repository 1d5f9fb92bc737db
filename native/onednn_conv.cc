// Convolutions for MindSpore Custom (aot) operators on CPU, run by oneDNN on blocked memory layouts.
//
// Why: MindSpore 2.10 hands oneDNN plain NCHW tensors, so oneDNN picks im2col+GEMM (or, above AVX2, its
// reference kernel). Letting oneDNN choose the layout ("any") gets its direct AVX-512 kernels; tensors
// are reordered from/to MindSpore's plain layout around each call, as PyTorch does.
//
// Each exported function has MindSpore's aot signature and handles one (stride, padding) pair, named
// in the function (Custom aot ops here take no attributes). Dilation 1, groups 1, float32, no bias.
// The library links MindSpore's own libdnnl.so.3, so it shares MindSpore's oneDNN and its ISA setting.
//
// Training, convolution + BatchNorm (ConvBn*): one call runs a convolution and the BatchNorm after it on the
// batch's statistics, the convolution's output kept in channel blocks for oneDNN's jit BatchNorm kernels
// (MindSpore's BatchNorm needs plain tensors and runs oneDNN's slower plain-layout kernel), and the gradient
// call feeds BatchNorm's input gradient to both convolution gradients without reordering it twice.
//
// Inference (ConvInference*, MaxPool*): activations stay in one layout from layer to layer, so no reorders run
// between layers: NHWC, where oneDNN runs its brgemm kernels, or channel blocks (nChw16c; nChw8c without
// AVX-512), where it runs its direct jit kernels (faster on small maps); the caller picks
// (src/fused_inference.py).
// BatchNorm comes folded into the weights and bias, ReLU and the residual addition run as oneDNN post-ops,
// and each layer's weights are reordered into the kernel's layout once per weights version.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <sched.h>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <vector>

#include <immintrin.h>

#include "oneapi/dnnl/dnnl.hpp"
#include "oneapi/dnnl/dnnl_threadpool.hpp"

#ifndef ONEDNN_CONV_SOURCE_DIGEST
#define ONEDNN_CONV_SOURCE_DIGEST "unknown"
#endif

namespace {

using dnnl::memory;
using tag = dnnl::memory::format_tag;

// Channels per block of the blocked layouts: 16 (one AVX-512 register of floats) when oneDNN runs AVX-512 code,
// else 8 (AVX2, SSE4.1). oneDNN's jit kernels for convolution, BatchNorm and pooling exist only for their
// ISA's block; on the other one it falls back to its reference kernels. The ISA in effect honours
// ONEDNN_MAX_CPU_ISA and is fixed from the first query on.
int ChannelBlock() {
  static const int block = [] {
    const int avx512_core = static_cast<int>(dnnl::cpu_isa::avx512_core);
    return (static_cast<int>(dnnl::get_effective_cpu_isa()) & avx512_core) == avx512_core ? 16 : 8;
  }();
  return block;
}

tag BlockedTag() { return ChannelBlock() == 16 ? tag::aBcd16b : tag::aBcd8b; }

// oneDNN in MindSpore is built for a caller-supplied thread pool. This one is synchronous: the
// calling thread takes a share, workers spin briefly (a step makes hundreds of short calls) then sleep.
// The spin is timed: MindSpore launches the next call 8-128 microseconds after the last one ends (most gaps of
// a step), and waking a sleeping worker costs more than spinning through that.
constexpr auto kWorkerSpin = std::chrono::microseconds(200);

// oneDNN splits a primitive's work into as many parts as its concurrency, one part per thread by default, so a
// call ends with the slower thread: on a busy or shared machine one core can run a fifth slower for seconds, and
// the caller then waits in its yield loop. With four parts a thread, handed out as threads come free, the faster
// thread takes the slower one's share (docs/performance.md: 1.37x inference at 224x224 with another process busy
// on one core, level without it).
constexpr int kPartsPerThread = 4;

class ThreadPool : public dnnl::threadpool_interop::threadpool_iface {
 public:
  explicit ThreadPool(int threads) : threads_(std::max(1, threads)) {
    for (int t = 1; t < threads_; ++t) workers_.emplace_back([this] { Work(); });
  }
  ~ThreadPool() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
      generation_.fetch_add(1);
    }
    wake_.notify_all();
    for (auto &worker : workers_) worker.join();
  }
  int get_num_threads() const override { return threads_; }
  bool get_in_parallel() const override { return in_parallel_; }
  uint64_t get_flags() const override { return 0; }
  void parallel_for(int n, const std::function<void(int, int)> &fn) override {
    if (n <= 0) return;
    if (threads_ == 1 || n == 1 || in_parallel_) {
      for (int i = 0; i < n; ++i) fn(i, n);
      return;
    }
    fn_ = &fn;
    n_ = n;
    next_.store(0);
    busy_.store(threads_ - 1);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    RunShare();
    while (busy_.load(std::memory_order_acquire) != 0) std::this_thread::yield();
  }

 private:
  void RunShare() {
    in_parallel_ = true;
    for (int i = next_.fetch_add(1); i < n_; i = next_.fetch_add(1)) (*fn_)(i, n_);
    in_parallel_ = false;
  }
  void Work() {
    uint64_t seen = 0;
    for (;;) {
      bool started = false;
      const auto until = std::chrono::steady_clock::now() + kWorkerSpin;
      for (int spin = 1;; ++spin) {
        started = generation_.load(std::memory_order_acquire) != seen;
        if (started || (spin % 32 == 0 && std::chrono::steady_clock::now() > until)) break;
        _mm_pause();  // frees the core's execution ports and power while polling
      }
      if (!started) {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_.load() != seen; });
      }
      seen = generation_.load(std::memory_order_acquire);
      if (stop_) return;
      RunShare();
      busy_.fetch_sub(1, std::memory_order_release);
    }
  }

  int threads_;
  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::atomic<uint64_t> generation_{0};
  bool stop_ = false;
  const std::function<void(int, int)> *fn_ = nullptr;
  int n_ = 0;
  std::atomic<int> next_{0};
  std::atomic<int> busy_{0};
  static thread_local bool in_parallel_;
};
thread_local bool ThreadPool::in_parallel_ = false;

// Threads for the pool, set from Python before the first call (onednn_conv_set_threads): MindSpore sets
// OMP_NUM_THREADS=1 in the process environment when it loads, so the user's value can't be read here.
std::atomic<int> requested_threads{0};

int ThreadCount() {
  if (requested_threads.load() > 0) return requested_threads.load();
  cpu_set_t cpus;
  if (sched_getaffinity(0, sizeof(cpus), &cpus) == 0) return CPU_COUNT(&cpus);
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

// The pool's size once it exists (0 before): onednn_conv_set_threads can no longer change it then.
std::atomic<int> pool_threads{0};

// What all calls share: one runs at a time, on one thread pool and stream.
struct Executor {
  static Executor &Get() {
    static Executor executor;
    return executor;
  }

  // Held for the whole call: the pool, stream and buffers are shared. Also sets oneDNN's concurrency, which is
  // thread-local and sizes each primitive's work split (MindSpore's threads may have it at 1).
  std::unique_lock<std::mutex> Begin() {
    std::unique_lock<std::mutex> lock(mutex);
    const int threads = pool.get_num_threads();
    dnnl_threadpool_interop_set_max_concurrency(threads > 1 ? threads * kPartsPerThread : 1);
    return lock;
  }

  std::mutex mutex;
  ThreadPool pool;
  dnnl::engine engine;
  dnnl::stream stream;

 private:
  Executor()
      : pool(ThreadCount()),
        engine(dnnl::engine::kind::cpu, 0),
        stream(dnnl::threadpool_interop::make_stream(engine, &pool)) {
    pool_threads.store(pool.get_num_threads());
  }
};

// A grow-only 64-byte-aligned buffer, kept between calls: fresh allocations of large tensors would page
// fault on every step.
class Buffer {
 public:
  void *Get(size_t bytes) {
    if (bytes > capacity_) {
      std::free(data_);
      data_ = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
      capacity_ = data_ ? bytes : 0;
    }
    return data_;
  }
  ~Buffer() { std::free(data_); }

 private:
  void *data_ = nullptr;
  size_t capacity_ = 0;
};

enum class Direction { kForward, kBackwardData, kBackwardWeights };

// One kernel tap of OIHW weights (`taps` = KH x KW per kernel) read as an (in, out) matrix: a view that starts
// at the tap, (kh * KW + kw) floats into the weights. A one-pixel map meets only one tap of each kernel.
memory::desc TapAsInOut(memory::dim in, memory::dim out, memory::dim taps) {
  return memory::desc({in, out}, memory::data_type::f32, memory::dims{taps, in * taps});
}

// The layouts a training convolution may leave its weight gradient in for the native update (the layouts tensor's
// third number): plain OIHW only; the kernel's channel blocks where it computes it so; those, or a window of the
// kernels where only that window ever meets the input, where nothing but the update reads the gradient.
enum class WeightGradient : int64_t { kPlain = 0, kBlocks = 1, kBlocksOrWindow = 2 };

// How a weight gradient was left for the native update: in channel blocks of `block` (ABcd{B}b{B}a), or
// (window_rows > 0) as a window of each kernel's taps only, dense (O, I, rows, cols) at the start of the
// gradient's memory, the window's first tap at window_first of each kernel, the other taps zero and the rest of
// the memory unwritten; else (both 0) plain OIHW.
struct GradientLayout {
  int block = 0;
  int64_t window_rows = 0, window_cols = 0, window_first = 0;
};

// Kernels [first, first + count) of a gradient left as `layout`'s window (dense (kernels, rows, cols) in `window`),
// in plain order in `kernels`: the window's taps in place, zero elsewhere.
void WindowToKernels(const GradientLayout &layout, const float *window, int64_t first, int64_t count, int64_t taps,
                     int64_t kernel_width, float *kernels) {
  const int64_t rows = layout.window_rows, cols = layout.window_cols;
  std::memset(kernels, 0, static_cast<size_t>(count * taps) * sizeof(float));
  for (int64_t k = 0; k < count; ++k) {
    const float *from = window + (first + k) * rows * cols;
    float *to = kernels + k * taps + layout.window_first;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) to[r * kernel_width + c] = from[r * cols + c];
    }
  }
}

// Weight gradients that training convolutions left in a layout of their own, by the address of the weights
// they are the gradient of (the parameter's, which the update receives too). An address, not a number per layer:
// a network's repeated blocks may run as one shared graph (ResNet's lazy_inline), whose constants are the first
// block's. Channel blocks save reordering the gradient to OIHW, a strided scatter that was the largest reorder of
// a training step; a window (the one-pixel and one-output-pixel layers, whose other taps only ever meet padding)
// saves writing and reading the zeros, most of the gradient. The native optimizer update reads the gradient,
// takes the entry and puts the gradient in OIHW order itself, a chunk at a time, in cache (UpdatePlan). Every
// other consumer of the gradients between the two must be element-wise or a global norm, which the order does
// not change, for blocks (clipping, unscaling, overflow checks), and there must be none for windows.
class GradientLayouts {
 public:
  static void Record(const void *weights, const GradientLayout &layout) {
    std::lock_guard<std::mutex> lock(Mutex());
    Map()[weights] = layout;
  }
  // The weights' entry, removed (plain where none): a step that did not write the gradient (a fallback) reads
  // plain.
  static GradientLayout Take(const void *weights) {
    std::lock_guard<std::mutex> lock(Mutex());
    auto found = Map().find(weights);
    if (found == Map().end()) return {};
    const GradientLayout layout = found->second;
    Map().erase(found);
    return layout;
  }
  // Drops the entries no update took (gradients computed without one), so that weights allocated later at the
  // same address can't take them. The update calls it after taking its own: a step's graph runs its backward and
  // its update together.
  static void Clear() {
    std::lock_guard<std::mutex> lock(Mutex());
    Map().clear();
  }

 private:
  static std::mutex &Mutex() {
    static std::mutex mutex;
    return mutex;
  }
  static std::unordered_map<const void *, GradientLayout> &Map() {
    static std::unordered_map<const void *, GradientLayout> map;
    return map;
  }
};

// B where `kernel` is the ABcd{B}b{B}a layout of OIHW `weights` with both channel counts in whole blocks (so it
// holds exactly the plain tensor's floats, in another order), else 0.
int KernelLayoutBlock(const memory::desc &kernel, const memory::dims &weights) {
  const std::pair<int, tag> layouts[] = {{16, tag::ABcd16b16a}, {8, tag::ABcd8b8a}};
  for (const auto &layout : layouts) {
    if (weights[0] % layout.first == 0 && weights[1] % layout.first == 0 &&
        kernel == memory::desc(weights, memory::data_type::f32, layout.second)) {
      return layout.first;
    }
  }
  return 0;
}

// A 2-D matrix (rows, columns) with plain strides as a batch of `parts` column blocks (parts, rows, columns /
// parts): a view of the same memory. oneDNN runs some matmuls with many columns on its GEMM, which ran layer4's
// (32 x K) x (K x 2048) products at 32x32 at about half the rate of its brgemm kernels with two threads; as a
// batch of column blocks (the source a batch of one, broadcast) it runs them on brgemm.
memory::desc ColumnBlocks(const memory::desc &matrix, int64_t parts) {
  const memory::dims dims = matrix.get_dims(), strides = matrix.get_strides();
  const int64_t n = dims[1] / parts;
  return memory::desc({parts, dims[0], n}, memory::data_type::f32, memory::dims{n * strides[1], strides[0],
                                                                              strides[1]});
}

memory::desc BatchOfOne(const memory::desc &matrix) {
  const memory::dims dims = matrix.get_dims(), strides = matrix.get_strides();
  return memory::desc({1, dims[0], dims[1]}, memory::data_type::f32, memory::dims{dims[0] * dims[1], strides[0],
                                                                                strides[1]});
}

template <typename PrimitiveDesc>
bool Brgemm(const PrimitiveDesc &pd) {
  return std::strncmp(pd.impl_info_str(), "brg", 3) == 0;
}

// An inference matmul with its weights in the layout oneDNN runs fastest: its own choice, except where that is
// its GEMM without AVX-512, which ran (32 x K) x (K x N) products 1.2-1.8x faster on weights stored as (N, K) rows
// (read transposed) than on its choice of (K, N) rows (a standalone oneDNN timing, two threads). nullopt where
// oneDNN has none for the shape and attributes, or only its reference kernel.
std::optional<dnnl::matmul::primitive_desc> InferenceMatmul(const dnnl::engine &engine, const memory::desc &src,
                                                            const memory::dims &weights, const memory::desc &bias,
                                                            const memory::desc &dst,
                                                            const dnnl::primitive_attr &attr) {
  const auto f32 = memory::data_type::f32;
  dnnl::matmul::primitive_desc pd;
  try {
    pd = dnnl::matmul::primitive_desc(engine, src, memory::desc(weights, f32, tag::any), bias, dst, attr);
  } catch (const dnnl::error &) {
    return std::nullopt;
  }
  if (ChannelBlock() != 16 && !Brgemm(pd)) {
    try {
      auto transposed =
          dnnl::matmul::primitive_desc(engine, src, memory::desc(weights, f32, tag::ba), bias, dst, attr);
      if (std::strncmp(transposed.impl_info_str(), "ref", 3) != 0) return transposed;
    } catch (const dnnl::error &) {
    }
  }
  if (std::strncmp(pd.impl_info_str(), "ref", 3) == 0) return std::nullopt;
  return pd;
}

// What the one output pixel of a convolution meets (output (0, 0) reads input pixel (tap row - pad, tap column -
// pad)): a window of rows x cols kernel taps, each at one input pixel. As views of x (in its layout, x_view) and of
// the OIHW weights (w_view), and as the same numbers in dense (N, I, rows, cols) / (O, I, rows, cols) tensors: the
// columns of a matrix product ordered (channel, tap row, tap column), as NCHW and OIHW order them. Where a view
// equals its dense tensor (the whole of a plain input, the whole kernel), the matrix is the tensor itself.
struct PixelWindow {
  int64_t rows, cols;
  memory::desc x_view, x_dense, w_view, w_dense;
};

// The window for x (logical NCHW dims), OIHW weights, the output's dims and symmetric padding; nullopt where the
// output is not one pixel or no tap meets the input.
std::optional<PixelWindow> OutputPixelWindow(const memory::desc &x, const memory::dims &weights,
                                             const memory::dims &dst, const memory::dims &padding) {
  const memory::dims src = x.get_dims();
  const int64_t kh = weights[2], kw = weights[3], pad = padding[0];
  if (dst[2] != 1 || dst[3] != 1 || padding[1] != pad) return std::nullopt;
  const int64_t row0 = std::max<int64_t>(0, pad), row1 = std::min(kh, src[2] + pad);
  const int64_t col0 = std::max<int64_t>(0, pad), col1 = std::min(kw, src[3] + pad);
  if (row1 <= row0 || col1 <= col0) return std::nullopt;
  const int64_t rows = row1 - row0, cols = col1 - col0;
  const auto f32 = memory::data_type::f32;
  return PixelWindow{rows, cols, x.submemory_desc({src[0], src[1], rows, cols}, {0, 0, row0 - pad, col0 - pad}),
                     memory::desc({src[0], src[1], rows, cols}, f32, tag::abcd),
                     memory::desc(weights, f32, tag::oihw).submemory_desc({weights[0], weights[1], rows, cols},
                                                                          {0, 0, row0, col0}),
                     memory::desc({weights[0], weights[1], rows, cols}, f32, tag::abcd)};
}

// A pool's right/bottom padding that gives exactly dst_dims, as torch computes it.
memory::dims PoolingPaddingR(const memory::dims &src_dims, const memory::dims &dst_dims, int kernel, int stride,
                             int padding) {
  memory::dims padding_r;
  for (int i = 2; i < 4; ++i) padding_r.push_back((dst_dims[i] - 1) * stride + kernel - src_dims[i] - padding);
  return padding_r;
}

// Convolutions on maps so small that every output pixel meets every input pixel, at stride 1: 3x3 kernels with
// padding 1 on a 2x2 map (layer3 at 32x32 inputs with the ImageNet stem). Each sample's whole input (C x H x W
// numbers in its layout) times a (C x H x W, O x Ho x Wo) matrix that holds, for each (input pixel, output pixel)
// pair, the weights of the tap between them, is the whole output in its layout. The product skips the taps that
// meet only padding (20 of the 36 per output pixel on a 2x2 map); oneDNN's convolution kernels ran these shapes at
// a fraction of its matmul's rate (with AVX2 the weight gradient on its GEMM, through plain layouts). A layout is
// described by its channel run: channels come in runs of `run` per pixel (run = the channel block for channel
// blocks, all channels for NHWC), so channel c of pixel p is number ((c / run) * pixels + p) * run + c % run.
struct PixelPairs {
  int64_t in, out, taps, pixels_in, pixels_out, x_run, y_run;
  std::vector<int64_t> pair_taps;  // for output pixel q and input pixel p, the tap at [q * pixels_in + p]

  int64_t columns() const { return in * pixels_in; }  // the matrix's rows are the output's numbers, columns x's
  int64_t rows() const { return out * pixels_out; }
  // The row of output channel o at output pixel q, and the output channel of a row.
  int64_t row(int64_t o, int64_t q) const { return ((o / y_run) * pixels_out + q) * y_run + o % y_run; }
  int64_t channel(int64_t row) const { return row / (pixels_out * y_run) * y_run + row % y_run; }
};

// The pairs for logical NCHW src / dst dims and OIHW weights, or nullopt where the stride is not 1, the input is one
// pixel or more than four, some pair meets no tap, or a run does not divide its channels.
std::optional<PixelPairs> AllPixelPairs(const memory::dims &src, const memory::dims &weights, const memory::dims &dst,
                                        const memory::dims &strides, const memory::dims &padding, int64_t x_run,
                                        int64_t y_run) {
  if (src[2] * src[3] == 1 || src[2] * src[3] > 4 || strides[0] != 1 || strides[1] != 1 || weights[1] % x_run != 0 ||
      weights[0] % y_run != 0) {
    return std::nullopt;
  }
  PixelPairs pairs{weights[1], weights[0], weights[2] * weights[3], src[2] * src[3], dst[2] * dst[3], x_run, y_run,
                   {}};
  for (int64_t q = 0; q < pairs.pixels_out; ++q) {
    for (int64_t p = 0; p < pairs.pixels_in; ++p) {
      const int64_t kh = p / src[3] - q / dst[3] + padding[0], kw = p % src[3] - q % dst[3] + padding[1];
      if (kh < 0 || kh >= weights[2] || kw < 0 || kw >= weights[3]) return std::nullopt;
      pairs.pair_taps.push_back(kh * weights[3] + kw);
    }
  }
  return pairs;
}

int StepVectorBits();

// Whether ExpandPairsRuns and FoldPairsRuns take the pairs: runs of 8 or 16 channels (training's channel blocks),
// kernels of at most kVectorTaps taps (3x3 has 9), and AVX2 allowed by the CPU and oneDNN's ISA in effect.
constexpr int64_t kVectorTaps = 32;
bool VectorRuns(const PixelPairs &pairs) {
  return (pairs.x_run == 8 || pairs.x_run == 16) && pairs.taps <= kVectorTaps && StepVectorBits() >= 256;
}

// Prefetches every cache line of the `bytes` bytes from `start`, by address: a span may begin or end outside its
// tensor (a prefetch never faults).
inline void PrefetchSpan(uintptr_t start, uintptr_t bytes) {
  for (uintptr_t line = start & ~uintptr_t{63}; line < start + bytes; line += 64) {
    _mm_prefetch(reinterpret_cast<const char *>(line), _MM_HINT_T0);
  }
}

// The rows of output channel o of the pairs' matrix, where x_run is one or two AVX2 vectors (the channel blocks of
// 8 or 16): each run's (channels, taps) weights gathered into vectors per tap, then stored whole to every pair the
// tap joins (the general loop's memcpy calls of 32 or 64 bytes took up to 2.4 times as long).
template <int64_t length>
__attribute__((target("avx2"))) void ExpandPairsRuns(const PixelPairs &pairs, const float *weights, int64_t o,
                                                     float *matrix) {
  const int64_t runs = pairs.in / length, taps = pairs.taps, k = pairs.columns();
  const int64_t pixels = pairs.pixels_in;
  const __m256i channels =
      _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(static_cast<int>(taps)));
  alignas(32) float by_tap[kVectorTaps * length];
  for (int64_t run = 0; run < runs; ++run) {
    const float *kernels = weights + (o * pairs.in + run * length) * taps;
    if (o + 1 < pairs.out) {  // the next channel's run: in a step the weights come from memory, not cache
      PrefetchSpan(reinterpret_cast<uintptr_t>(kernels + pairs.in * taps), length * taps * sizeof(float));
    }
    for (int64_t t = 0; t < taps; ++t) {
      for (int64_t c = 0; c < length; c += 8) {
        _mm256_store_ps(by_tap + t * length + c, _mm256_i32gather_ps(kernels + c * taps + t, channels, 4));
      }
    }
    for (int64_t q = 0; q < pairs.pixels_out; ++q) {
      float *row = matrix + pairs.row(o, q) * k + run * pixels * length;
      for (int64_t p = 0; p < pixels; ++p) {
        const float *from = by_tap + pairs.pair_taps[q * pixels + p] * length;
        for (int64_t c = 0; c < length; c += 8) _mm256_storeu_ps(row + p * length + c, _mm256_load_ps(from + c));
      }
    }
  }
}

// The pairs' matrix from OIHW weights, stored transposed: (rows, columns) row-major. Runs of 8 or 16 channels
// (training's channel blocks) take ExpandPairsRuns; otherwise each output channel's (I, taps) weights are
// first transposed to (taps, I) in cache, so that each pair's weights are runs of channels.
void ExpandPixelPairs(const PixelPairs &pairs, const float *weights, float *matrix, ThreadPool &pool) {
  const int out = static_cast<int>(pairs.out);
  if (VectorRuns(pairs)) {
    const auto expand = pairs.x_run == 8 ? ExpandPairsRuns<8> : ExpandPairsRuns<16>;
    return pool.parallel_for(out, [&](int o, int) { expand(pairs, weights, o, matrix); });
  }
  const int64_t k = pairs.columns(), runs = pairs.in / pairs.x_run;
  pool.parallel_for(out, [&](int o, int) {
    std::vector<float> by_tap(static_cast<size_t>(pairs.taps * pairs.in));
    const float *kernels = weights + o * pairs.in * pairs.taps;
    for (int64_t c = 0; c < pairs.in; ++c) {
      for (int64_t t = 0; t < pairs.taps; ++t) by_tap[t * pairs.in + c] = kernels[c * pairs.taps + t];
    }
    for (int64_t q = 0; q < pairs.pixels_out; ++q) {
      float *row = matrix + pairs.row(o, q) * k;
      for (int64_t run = 0; run < runs; ++run) {
        for (int64_t p = 0; p < pairs.pixels_in; ++p) {
          const float *from = by_tap.data() + pairs.pair_taps[q * pairs.pixels_in + p] * pairs.in + run * pairs.x_run;
          std::memcpy(row + (run * pairs.pixels_in + p) * pairs.x_run, from, pairs.x_run * sizeof(float));
        }
      }
    }
  });
}

// Output channel o of dw (plain OIHW) from the matrix's gradient, where x_run is one or two AVX2 vectors: each run's
// sums over the pairs each tap joins, in vectors, then stored to their (channel, tap) places.
template <int64_t length>
__attribute__((target("avx2"))) void FoldPairsRuns(const PixelPairs &pairs, const float *matrix_gradient, int64_t o,
                                                   float *dw) {
  const int64_t runs = pairs.in / length, taps = pairs.taps, k = pairs.columns();
  const int64_t pixels = pairs.pixels_in;
  alignas(32) float by_tap[kVectorTaps * length];
  for (int64_t run = 0; run < runs; ++run) {
    for (int64_t i = 0; i < taps * length; i += 8) _mm256_store_ps(by_tap + i, _mm256_setzero_ps());
    for (int64_t q = 0; q < pairs.pixels_out; ++q) {
      const float *row = matrix_gradient + pairs.row(o, q) * k + run * pixels * length;
      for (int64_t p = 0; p < pixels; ++p) {
        float *sum = by_tap + pairs.pair_taps[q * pixels + p] * length;
        for (int64_t c = 0; c < length; c += 8) {
          _mm256_store_ps(sum + c, _mm256_add_ps(_mm256_load_ps(sum + c), _mm256_loadu_ps(row + p * length + c)));
        }
      }
    }
    float *kernels = dw + (o * pairs.in + run * length) * taps;
    for (int64_t c = 0; c < length; ++c) {
      for (int64_t t = 0; t < taps; ++t) kernels[c * taps + t] = by_tap[t * length + c];
    }
  }
}

// dw (plain OIHW) from the gradient of the (rows, columns) matrix: each tap's gradient is the sum over the pairs
// it joins. Runs of 8 or 16 channels take FoldPairsRuns.
void FoldPixelPairs(const PixelPairs &pairs, const float *matrix_gradient, float *dw, ThreadPool &pool) {
  const int out = static_cast<int>(pairs.out);
  if (VectorRuns(pairs)) {
    const auto fold = pairs.x_run == 8 ? FoldPairsRuns<8> : FoldPairsRuns<16>;
    return pool.parallel_for(out, [&](int o, int) { fold(pairs, matrix_gradient, o, dw); });
  }
  const int64_t k = pairs.columns(), runs = pairs.in / pairs.x_run;
  pool.parallel_for(out, [&](int o, int) {
    std::vector<float> by_tap(static_cast<size_t>(pairs.taps * pairs.in), 0.0f);
    for (int64_t q = 0; q < pairs.pixels_out; ++q) {
      const float *row = matrix_gradient + pairs.row(o, q) * k;
      for (int64_t run = 0; run < runs; ++run) {
        for (int64_t p = 0; p < pairs.pixels_in; ++p) {
          float *to = by_tap.data() + pairs.pair_taps[q * pairs.pixels_in + p] * pairs.in + run * pairs.x_run;
          const float *from = row + (run * pairs.pixels_in + p) * pairs.x_run;
          for (int64_t i = 0; i < pairs.x_run; ++i) to[i] += from[i];
        }
      }
    }
    float *kernels = dw + o * pairs.in * pairs.taps;
    for (int64_t c = 0; c < pairs.in; ++c) {
      for (int64_t t = 0; t < pairs.taps; ++t) kernels[c * pairs.taps + t] = by_tap[t * pairs.in + c];
    }
  });
}

// Primitive and layouts for one convolution shape and direction, created once.
// kAccumulateRelu: dst = ReLU(dst + conv(x) + bias), the residual being dst's own content (a stage's running
// activation, StageInference), which saves kAddRelu's read of a separate residual and its separate output stream.
enum class PostOp { kNone, kRelu, kAddRelu, kAccumulateRelu };

// Inference's matrix products of a batch with large weights (AVX-512 too: PanelKernelsUsable): (m, k) rows times
// (k, n) weights, plus a bias per column, then the post-op. oneDNN's only AVX2 matmul is its GEMM, which packs the
// weights again at every call: (32 x 1024) x (1024 x 1024) products ran at 115-135 GFLOP/s on two threads, against
// 160-175 here with the weights packed once per version (a standalone timing). The weights are kept as panels of 16
// columns, (n / 16, k, 16); each panel meets the rows 6 at a time (12 accumulators of the 16 vector registers), over
// slices of 256 of k, so that the panel's slice stays in L1 across the row blocks.
constexpr int64_t kPanelColumns = 16, kPanelRowBlock = 6, kPanelSlice = 256;
// Panel rows (a cache line each) that the products prefetch ahead: at batch 32 the first row block reads each
// slice from memory (inference's one-pixel layers read about 85 MB of weights a pass), and the hardware's
// prefetcher alone left it waiting.
constexpr int64_t kPanelPrefetch = 64;

inline void PrefetchPanelRow(const float *panel, int64_t i) {  // past the panels' end too: a hint never faults
  const uintptr_t row = reinterpret_cast<uintptr_t>(panel) + (i + kPanelPrefetch) * kPanelColumns * sizeof(float);
  _mm_prefetch(reinterpret_cast<const char *>(row), _MM_HINT_T0);
}

// Whether this machine and oneDNN's ISA in effect run the panels: AVX2 without AVX-512 (AVX-512 has oneDNN's
// brgemm matmul on packed weights; only inference's products leave it there, PanelKernelsUsable), whole panels
// only.
bool PanelsUsable(int64_t n) {
  return StepVectorBits() == 256 && __builtin_cpu_supports("fma") && n % kPanelColumns == 0;
}

// The panels' layout, and a view of (k, n) weights (any strides) in the panels' logical dims, which a reorder
// packs into it.
memory::desc PanelsDesc(int64_t k, int64_t n) {
  return memory::desc({n / kPanelColumns, k, kPanelColumns}, memory::data_type::f32, tag::abc);
}
memory::desc PanelsView(const memory::desc &weights) {
  const memory::dims dims = weights.get_dims(), strides = weights.get_strides();
  return memory::desc({dims[1] / kPanelColumns, dims[0], kPanelColumns}, memory::data_type::f32,
                      memory::dims{kPanelColumns * strides[1], strides[0], strides[1]});
}

// What the last slice adds: the panel's 16 biases, the residual rows (or null), then ReLU or not.
struct PanelEpilogue {
  const float *bias;
  const float *residual;
  int64_t residual_stride;
  bool relu;
};

// Rows [0, R) of c's panel columns over one slice of k: c = a x panel (first slice) or c += a x panel, then the
// epilogue on the last. a's element (r, i) is a[r * lda + i], or with kColumns (a read down its columns: the
// Winograd weight gradient's output gradients, tiles by channel) a[i * lda + r].
template <int R, bool kColumns = false>
__attribute__((target("avx2,fma"))) void PanelRows(const float *a, int64_t lda, const float *panel, int64_t depth,
                                                    float *c, int64_t ldc, bool first, const PanelEpilogue *last) {
  __m256 low[R], high[R];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    low[r] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + r * ldc);
    high[r] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + r * ldc + 8);
  }
  for (int64_t i = 0; i < depth; ++i) {
    PrefetchPanelRow(panel, i);
    const __m256 panel_low = _mm256_load_ps(panel + i * kPanelColumns);
    const __m256 panel_high = _mm256_load_ps(panel + i * kPanelColumns + 8);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 value = _mm256_broadcast_ss(kColumns ? a + i * lda + r : a + r * lda + i);
      low[r] = _mm256_fmadd_ps(value, panel_low, low[r]);
      high[r] = _mm256_fmadd_ps(value, panel_high, high[r]);
    }
  }
  if (last != nullptr) {
    const __m256 bias_low = _mm256_loadu_ps(last->bias), bias_high = _mm256_loadu_ps(last->bias + 8);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      low[r] = _mm256_add_ps(low[r], bias_low);
      high[r] = _mm256_add_ps(high[r], bias_high);
      if (last->residual != nullptr) {
        low[r] = _mm256_add_ps(low[r], _mm256_loadu_ps(last->residual + r * last->residual_stride));
        high[r] = _mm256_add_ps(high[r], _mm256_loadu_ps(last->residual + r * last->residual_stride + 8));
      }
      if (last->relu) {
        low[r] = _mm256_max_ps(low[r], _mm256_setzero_ps());
        high[r] = _mm256_max_ps(high[r], _mm256_setzero_ps());
      }
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(c + r * ldc, low[r]);
    _mm256_storeu_ps(c + r * ldc + 8, high[r]);
  }
}

// The epilogue of row r's 16 columns from `column` on, with AVX-512: plus the bias (those columns' 16, loaded once
// per row block), the residual row where there is one, then ReLU where asked.
__attribute__((target("avx512f"), always_inline)) inline __m512 FinishRow512(__m512 sum, __m512 bias,
                                                                             const PanelEpilogue &last, int64_t r,
                                                                             int64_t column) {
  sum = _mm512_add_ps(sum, bias);
  if (last.residual != nullptr) {
    sum = _mm512_add_ps(sum, _mm512_loadu_ps(last.residual + r * last.residual_stride + column));
  }
  return last.relu ? _mm512_max_ps(sum, _mm512_setzero_ps()) : sum;
}

// PanelRows with AVX-512: a panel's 16 columns are one vector, so a row takes one accumulator and 12 rows (of the
// 32 registers) hide the FMAs' latency.
template <int R, bool kColumns = false>
__attribute__((target("avx512f"))) void PanelRows512(const float *a, int64_t lda, const float *panel, int64_t depth,
                                                      float *c, int64_t ldc, bool first, const PanelEpilogue *last) {
  __m512 sums[R];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) sums[r] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + r * ldc);
  for (int64_t i = 0; i < depth; ++i) {
    PrefetchPanelRow(panel, i);
    const __m512 columns = _mm512_load_ps(panel + i * kPanelColumns);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      sums[r] = _mm512_fmadd_ps(_mm512_set1_ps(kColumns ? a[i * lda + r] : a[r * lda + i]), columns, sums[r]);
    }
  }
  if (last != nullptr) {
    const __m512 bias = _mm512_loadu_ps(last->bias);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) sums[r] = FinishRow512(sums[r], bias, *last, r, 0);
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(c + r * ldc, sums[r]);
}

// Whether PanelRowBlock runs PanelRows512: where oneDNN's ISA in effect is AVX-512 (the Winograd layers' and
// inference's matrix products run on the panels there).
bool PanelsAvx512() {
  static const bool avx512 = StepVectorBits() == 512;
  return avx512;
}

// Whether the panels' kernels run here: AVX2 with FMA (PanelRows) or AVX-512 (PanelRows512, PanelPairRows512),
// whole panels only. The Winograd layers' products and inference's matrix products (MatrixPlan) run on them wherever
// they do; training's matrix products only without AVX-512 (PanelsUsable). At 32x32 inputs inference's products are
// (32 x K) x (K x N) with weights from memory (about 85 MB a pass); with 16 copies of the weights cycled, AVX-512's
// paired panels ran ResNet-50's four shapes at 382-453 GFLOP/s, against 331-358 for oneDNN's matmul (its GEMM or
// brgemm), and at 482-495 against 453-485 with the weights in the L3 (a standalone timing, two threads).
bool PanelKernelsUsable(int64_t n) {
  return StepVectorBits() >= 256 && __builtin_cpu_supports("fma") && n % kPanelColumns == 0;
}

// Rows a call of PanelRowBlock takes at most: 12 with AVX-512, else kPanelRowBlock.
int64_t PanelRowsAtOnce() { return PanelsAvx512() ? 12 : kPanelRowBlock; }

// PanelRows for a block of `rows` (1 to PanelRowsAtOnce()) rows.
template <bool kColumns = false>
void PanelRowBlock(int64_t rows, const float *a, int64_t lda, const float *panel, int64_t depth, float *c,
                   int64_t ldc, bool first, const PanelEpilogue *last) {
  if (PanelsAvx512()) {
    switch (rows) {
      case 12: PanelRows512<12, kColumns>(a, lda, panel, depth, c, ldc, first, last); return;
      case 11: PanelRows512<11, kColumns>(a, lda, panel, depth, c, ldc, first, last); return;
      case 10: PanelRows512<10, kColumns>(a, lda, panel, depth, c, ldc, first, last); return;
      case 9: PanelRows512<9, kColumns>(a, lda, panel, depth, c, ldc, first, last); return;
      case 8: PanelRows512<8, kColumns>(a, lda, panel, depth, c, ldc, first, last); return;
      case 7: PanelRows512<7, kColumns>(a, lda, panel, depth, c, ldc, first, last); return;
      case 6: PanelRows512<6, kColumns>(a, lda, panel, depth, c, ldc, first, last); return;
      case 5: PanelRows512<5, kColumns>(a, lda, panel, depth, c, ldc, first, last); return;
      case 4: PanelRows512<4, kColumns>(a, lda, panel, depth, c, ldc, first, last); return;
      case 3: PanelRows512<3, kColumns>(a, lda, panel, depth, c, ldc, first, last); return;
      case 2: PanelRows512<2, kColumns>(a, lda, panel, depth, c, ldc, first, last); return;
      default: PanelRows512<1, kColumns>(a, lda, panel, depth, c, ldc, first, last); return;
    }
  }
  switch (rows) {
    case 6: PanelRows<6, kColumns>(a, lda, panel, depth, c, ldc, first, last); break;
    case 5: PanelRows<5, kColumns>(a, lda, panel, depth, c, ldc, first, last); break;
    case 4: PanelRows<4, kColumns>(a, lda, panel, depth, c, ldc, first, last); break;
    case 3: PanelRows<3, kColumns>(a, lda, panel, depth, c, ldc, first, last); break;
    case 2: PanelRows<2, kColumns>(a, lda, panel, depth, c, ldc, first, last); break;
    default: PanelRows<1, kColumns>(a, lda, panel, depth, c, ldc, first, last); break;
  }
}

// Panel p's 16 columns of c (m, n) = a (m, k) x panels, over every row block and slice of k; where bias is given,
// plus the bias [+ residual (m, n)] and the post-op on the last slice. With kAccumulateRelu the first slice adds to
// c's content (the residual) instead. With packed, a is in PackRowBlocks' layout.
void PanelColumns(int64_t p, int64_t m, int64_t k, int64_t n, const float *a, const float *panels, const float *bias,
                  const float *residual, PostOp post, float *c, bool packed = false) {
  const int64_t column = p * kPanelColumns, block = PanelRowsAtOnce();
  const bool accumulate = post == PostOp::kAccumulateRelu;
  if (accumulate) residual = nullptr;
  for (int64_t start = 0; start < k; start += kPanelSlice) {
    const int64_t depth = std::min(kPanelSlice, k - start);
    const float *panel = panels + (p * k + start) * kPanelColumns;
    for (int64_t row = 0; row < m; row += block) {
      const PanelEpilogue epilogue{bias ? bias + column : nullptr, residual ? residual + row * n + column : nullptr, n,
                                   post != PostOp::kNone};
      const PanelEpilogue *last = bias != nullptr && start + depth == k ? &epilogue : nullptr;
      const int64_t rows = std::min(block, m - row);
      if (packed) {
        PanelRowBlock<true>(rows, a + row * k + start * rows, rows, panel, depth, c + row * n + column, n,
                            start == 0 && !accumulate, last);
      } else {
        PanelRowBlock(rows, a + row * k + start, k, panel, depth, c + row * n + column, n, start == 0 && !accumulate,
                      last);
      }
    }
  }
}

// Rows [0, R) of two adjacent panels' 32 columns over one slice of k, with AVX-512, then the epilogue (its bias and
// residual rows 32 columns wide) on the last: each broadcast of a's element feeds two FMAs, where PanelRows512 loads
// one per FMA. With kColumns, a's rows are its columns (as in PanelRows).
template <int R, bool kColumns = false>
__attribute__((target("avx512f"))) void PanelPairRows512(const float *a, int64_t lda, const float *panel,
                                                          const float *next_panel, int64_t depth, float *c,
                                                          int64_t ldc, bool first, const PanelEpilogue *last) {
  __m512 left[R], right[R];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    left[r] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + r * ldc);
    right[r] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + r * ldc + kPanelColumns);
  }
  for (int64_t i = 0; i < depth; ++i) {
    PrefetchPanelRow(panel, i);
    PrefetchPanelRow(next_panel, i);
    const __m512 columns = _mm512_load_ps(panel + i * kPanelColumns);
    const __m512 next_columns = _mm512_load_ps(next_panel + i * kPanelColumns);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512 value = _mm512_set1_ps(kColumns ? a[i * lda + r] : a[r * lda + i]);
      left[r] = _mm512_fmadd_ps(value, columns, left[r]);
      right[r] = _mm512_fmadd_ps(value, next_columns, right[r]);
    }
  }
  if (last != nullptr) {
    const __m512 bias = _mm512_loadu_ps(last->bias), next_bias = _mm512_loadu_ps(last->bias + kPanelColumns);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      left[r] = FinishRow512(left[r], bias, *last, r, 0);
      right[r] = FinishRow512(right[r], next_bias, *last, r, kPanelColumns);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(c + r * ldc, left[r]);
    _mm512_storeu_ps(c + r * ldc + kPanelColumns, right[r]);
  }
}

// PanelPairRows512 for a block of `rows` (1 to 12) rows.
template <bool kColumns = false>
void PanelPairRowBlock(int64_t rows, const float *a, int64_t lda, const float *panel, const float *next_panel,
                       int64_t depth, float *c, int64_t ldc, bool first, const PanelEpilogue *last) {
  switch (rows) {
    case 12: PanelPairRows512<12, kColumns>(a, lda, panel, next_panel, depth, c, ldc, first, last); return;
    case 11: PanelPairRows512<11, kColumns>(a, lda, panel, next_panel, depth, c, ldc, first, last); return;
    case 10: PanelPairRows512<10, kColumns>(a, lda, panel, next_panel, depth, c, ldc, first, last); return;
    case 9: PanelPairRows512<9, kColumns>(a, lda, panel, next_panel, depth, c, ldc, first, last); return;
    case 8: PanelPairRows512<8, kColumns>(a, lda, panel, next_panel, depth, c, ldc, first, last); return;
    case 7: PanelPairRows512<7, kColumns>(a, lda, panel, next_panel, depth, c, ldc, first, last); return;
    case 6: PanelPairRows512<6, kColumns>(a, lda, panel, next_panel, depth, c, ldc, first, last); return;
    case 5: PanelPairRows512<5, kColumns>(a, lda, panel, next_panel, depth, c, ldc, first, last); return;
    case 4: PanelPairRows512<4, kColumns>(a, lda, panel, next_panel, depth, c, ldc, first, last); return;
    case 3: PanelPairRows512<3, kColumns>(a, lda, panel, next_panel, depth, c, ldc, first, last); return;
    case 2: PanelPairRows512<2, kColumns>(a, lda, panel, next_panel, depth, c, ldc, first, last); return;
    default: PanelPairRows512<1, kColumns>(a, lda, panel, next_panel, depth, c, ldc, first, last); return;
  }
}

// Panels p and p + 1 of c (m, n) = a (m, k) x panels, with AVX-512; where bias is given, plus the bias [+ residual
// (m, n)] and the post-op on the last slice (inference's products; the Winograd products have none); with
// kAccumulateRelu the first slice adds to c's content. With packed, a is in PackRowBlocks' layout.
void PanelColumnPair(int64_t p, int64_t m, int64_t k, int64_t n, const float *a, const float *panels,
                     const float *bias, const float *residual, PostOp post, float *c, bool packed = false) {
  const int64_t column = p * kPanelColumns;
  const bool accumulate = post == PostOp::kAccumulateRelu;
  if (accumulate) residual = nullptr;
  for (int64_t start = 0; start < k; start += kPanelSlice) {
    const int64_t depth = std::min(kPanelSlice, k - start);
    const float *panel = panels + (p * k + start) * kPanelColumns, *next = panel + k * kPanelColumns;
    for (int64_t row = 0; row < m; row += 12) {
      const int64_t rows = std::min<int64_t>(12, m - row);
      float *out = c + row * n + column;
      const PanelEpilogue epilogue{bias ? bias + column : nullptr, residual ? residual + row * n + column : nullptr, n,
                                   post != PostOp::kNone};
      const PanelEpilogue *last = bias != nullptr && start + depth == k ? &epilogue : nullptr;
      if (packed) {
        PanelPairRowBlock<true>(rows, a + row * k + start * rows, rows, panel, next, depth, out, n,
                                start == 0 && !accumulate, last);
      } else {
        PanelPairRowBlock(rows, a + row * k + start, k, panel, next, depth, out, n, start == 0 && !accumulate, last);
      }
    }
  }
}

// a (m, k) copied into `packed` (m x k floats) in blocks of PanelRowsAtOnce() rows, each block column by column
// (its `rows` numbers of column i at i * rows), the threads taking a share of the columns. Read in place, an
// AVX-512 row block's 12 rows lie k floats apart: where k is a multiple of 1024 (4 KB, as in ResNet's products of
// 1024 and 2048 numbers) they all fall in one set of the 8-way L1 and evict each other at every step. (32 x 1024) x
// (1024 x 1024) ran at 149 GFLOP/s in place and 207 packed, (32 x 2048) x (2048 x 512) at 149 and 196, (32 x 512) x
// (512 x 2048) at 207 and 212 (Zen 4, two threads, weights in the L3, a standalone timing with the copy).
void PackRowBlocks(dnnl::threadpool_interop::threadpool_iface &pool, int64_t m, int64_t k, const float *a,
                   float *packed) {
  const int64_t block = PanelRowsAtOnce();
  const int threads = static_cast<int>(std::min<int64_t>(pool.get_num_threads(), (k + 63) / 64));
  pool.parallel_for(threads, [&](int thread, int) {
    const int64_t first = k * thread / threads, end = k * (thread + 1) / threads;
    for (int64_t row = 0; row < m; row += block) {
      const int64_t rows = std::min(block, m - row);
      const float *from = a + row * k;
      float *to = packed + row * k;
      for (int64_t i = first; i < end; ++i) {
        for (int64_t r = 0; r < rows; ++r) to[i * rows + r] = from[r * k + i];
      }
    }
  });
}

// c (m, n) = post(a (m, k) x panels + bias [+ residual (m, n)]), the panels split among the pool's threads: in
// pairs with AVX-512 where they pair up, reading a packed into `packed_rows` with AVX-512 (PackRowBlocks).
void PanelMatmul(dnnl::threadpool_interop::threadpool_iface &pool, int64_t m, int64_t k, int64_t n, const float *a,
                 const float *panels, const float *bias, const float *residual, PostOp post, float *c,
                 Buffer &packed_rows) {
  const int64_t count = n / kPanelColumns, width = PanelsAvx512() && count % 2 == 0 ? 2 : 1, units = count / width;
  const int threads = static_cast<int>(std::min<int64_t>(pool.get_num_threads(), units));
  const bool packed = PanelsAvx512();
  if (packed) {
    float *rows = static_cast<float *>(packed_rows.Get(static_cast<size_t>(m * k) * sizeof(float)));
    PackRowBlocks(pool, m, k, a, rows);
    a = rows;
  }
  pool.parallel_for(threads, [&](int thread, int) {
    for (int64_t unit = units * thread / threads; unit < units * (thread + 1) / threads; ++unit) {
      if (width == 2) {
        PanelColumnPair(2 * unit, m, k, n, a, panels, bias, residual, post, c, packed);
      } else {
        PanelColumns(unit, m, k, n, a, panels, bias, residual, post, c, packed);
      }
    }
  });
}

// Training's matrix products of a batch with large weights, on AVX2: the forward and input gradient of the
// one-pixel, gathered and small-map convolutions of layer3 and layer4 at 32x32 inputs, (32 x K) x (K x N). oneDNN
// runs them on its GEMM, at 84-160 GFLOP/s, slowest on (K, N) weights read by rows (the input gradient): 84-120 in a
// standalone timing of these shapes on two threads, against 122-144 here; the forward ran 1.06-1.24x oneDNN's here.
// Their weight gradients, (N x 32) x (32 x K), stay on oneDNN's GEMM, which ran them at 155-170 (0.86-1.03x here).
constexpr int64_t kSmallSide = 64;  // the batch's largest size

// A 2-D operand: element (r, c) at data[r * row_stride + c * column_stride].
struct MatrixView {
  const float *data;
  int64_t rows, columns, row_stride, column_stride;
  float at(int64_t r, int64_t c) const { return data[r * row_stride + c * column_stride]; }
};

// How SmallMatmul runs c = a x b (c in plain rows), or kNone: oneDNN's matmul runs it.
enum class SmallProduct {
  kNone,
  kBatchTimesPanels,  // a: a batch of rows; b: (k, n) rows, copied slice by slice into panels (the input gradient)
  kBatchRows,         // a: a batch of rows; b: (n, k) rows: c^T = b^T x a^T with a^T in panels (the forward)
};

SmallProduct SmallProductFor(const memory::desc &a, const memory::desc &b, const memory::desc &c) {
  if (!PanelsUsable(kPanelColumns) || a.get_ndims() != 2 || b.get_ndims() != 2) return SmallProduct::kNone;
  const memory::dims ad = a.get_dims(), as = a.get_strides(), bs = b.get_strides(), cd = c.get_dims();
  if (c.get_strides() != memory::dims{cd[1], 1} || ad[0] > kSmallSide || as[1] != 1) return SmallProduct::kNone;
  if (bs[1] == 1 && cd[1] % kPanelColumns == 0) return SmallProduct::kBatchTimesPanels;
  return bs[0] == 1 ? SmallProduct::kBatchRows : SmallProduct::kNone;
}

// c (m, n) = a (m, k) x b (k, n), a and b by rows: each thread takes whole panels of 16 columns of b, copied one
// slice of the depth at a time into an L1 buffer (b's rows are thousands of floats apart: read in place, a slice's
// 256 rows would fall into a few cache sets), each slice meeting all of a's rows.
void BatchTimesPanels(dnnl::threadpool_interop::threadpool_iface &pool, const MatrixView &a, const MatrixView &b,
                      float *c) {
  const int64_t m = a.rows, k = a.columns, n = b.columns, count = n / kPanelColumns;
  const int threads = static_cast<int>(std::min<int64_t>(pool.get_num_threads(), count));
  pool.parallel_for(threads, [&](int thread, int) {
    alignas(64) float panel[kPanelSlice * kPanelColumns];
    for (int64_t p = count * thread / threads; p < count * (thread + 1) / threads; ++p) {
      for (int64_t start = 0; start < k; start += kPanelSlice) {
        const int64_t depth = std::min(kPanelSlice, k - start);
        for (int64_t i = 0; i < depth; ++i) {
          std::memcpy(panel + i * kPanelColumns, b.data + (start + i) * b.row_stride + p * kPanelColumns,
                      sizeof(float) * kPanelColumns);
        }
        for (int64_t row = 0; row < m; row += kPanelRowBlock) {
          PanelRowBlock(std::min(kPanelRowBlock, m - row), a.data + row * a.row_stride + start, a.row_stride, panel,
                        depth, c + row * n + p * kPanelColumns, n, start == 0, nullptr);
        }
      }
    }
  });
}

// c (m, n) = a (m, k) x b^T, b given as its (n, k) rows, by way of c^T = b x a^T: a^T in panels of 16 of the
// batch's rows (zero past the last), b's rows broadcast 6 at a time; each thread takes whole blocks of 6 of b's
// rows, over slices of the depth. c^T goes through `transposed`, a block at a time.
void BatchRows(dnnl::threadpool_interop::threadpool_iface &pool, const MatrixView &a, const MatrixView &b, float *c,
               Buffer *panels, Buffer *transposed) {
  const int64_t m = a.rows, k = a.columns, n = b.rows, lda = b.row_stride;
  const int64_t count = (m + kPanelColumns - 1) / kPanelColumns, width = count * kPanelColumns;
  float *packed = static_cast<float *>(panels->Get(static_cast<size_t>(count * k * kPanelColumns) * sizeof(float)));
  for (int64_t p = 0; p < count; ++p) {
    for (int64_t i = 0; i < k; ++i) {
      float *row = packed + (p * k + i) * kPanelColumns;
      for (int64_t j = 0; j < kPanelColumns; ++j) {
        const int64_t r = p * kPanelColumns + j;
        row[j] = r < m ? a.at(r, i) : 0.0f;
      }
    }
  }
  float *result = static_cast<float *>(transposed->Get(static_cast<size_t>(n * width) * sizeof(float)));
  const int64_t blocks = (n + kPanelRowBlock - 1) / kPanelRowBlock;
  const int threads = static_cast<int>(std::min<int64_t>(pool.get_num_threads(), blocks));
  pool.parallel_for(threads, [&](int thread, int) {
    for (int64_t block = blocks * thread / threads; block < blocks * (thread + 1) / threads; ++block) {
      const int64_t row = block * kPanelRowBlock, rows = std::min(kPanelRowBlock, n - row);
      for (int64_t start = 0; start < k; start += kPanelSlice) {
        const int64_t depth = std::min(kPanelSlice, k - start);
        for (int64_t p = 0; p < count; ++p) {
          PanelRowBlock(rows, b.data + row * lda + start, lda, packed + (p * k + start) * kPanelColumns, depth,
                        result + row * width + p * kPanelColumns, width, start == 0, nullptr);
        }
      }
      for (int64_t i = 0; i < m; ++i) {  // the block's columns of c, while its rows of c^T are in L1
        for (int64_t r = 0; r < rows; ++r) c[i * n + row + r] = result[(row + r) * width + i];
      }
    }
  });
}

// c (m, n), plain rows, = a (m, k) x b (k, n) as SmallProductFor says (not kNone); `panels` and `transposed` are
// scratch buffers.
void SmallMatmul(dnnl::threadpool_interop::threadpool_iface &pool, SmallProduct kind, const MatrixView &a,
                 const MatrixView &b, float *c, Buffer *panels, Buffer *transposed) {
  if (kind == SmallProduct::kBatchTimesPanels) {
    BatchTimesPanels(pool, a, b, c);
  } else {
    BatchRows(pool, a, MatrixView{b.data, b.columns, b.rows, b.column_stride, b.row_stride}, c, panels, transposed);
  }
}

// A 1x1 stride-2 layer's input gradient in channel blocks, (N, C, height, width), from its values at the even pixels
// (TransposedDataGradient): `even` (N, C, h, w) in channel blocks, pixel (i, j) going to (2i, 2j); zeros
// everywhere else.
void SpreadToEvenPixels(dnnl::threadpool_interop::threadpool_iface &pool, const memory::dims &even, int64_t height,
                        int64_t width, const float *from, float *to) {
  const int64_t block = ChannelBlock(), planes = even[0] * (even[1] / block), h = even[2], w = even[3];
  const int threads = static_cast<int>(std::min<int64_t>(pool.get_num_threads(), planes));
  pool.parallel_for(threads, [&](int thread, int) {
    for (int64_t plane = planes * thread / threads; plane < planes * (thread + 1) / threads; ++plane) {
      const float *in = from + plane * h * w * block;
      float *out = to + plane * height * width * block;
      for (int64_t r = 0; r < height; ++r) {  // h and w are height and width halved, rounded up
        float *row = out + r * width * block;
        if (r % 2 != 0) {
          std::fill_n(row, width * block, 0.0f);
          continue;
        }
        for (int64_t c = 0; c < width; ++c) {
          if (c % 2 == 0) {
            std::copy_n(in + ((r / 2) * w + c / 2) * block, block, row + c * block);
          } else {
            std::fill_n(row + c * block, block, 0.0f);
          }
        }
      }
    }
  });
}

// 3x3 stride-1 convolutions (padding 1) on AVX2's 8-channel blocks, in inference and for training's gradients
// (TrainingWinograd; the forward too where large, as F(4x4, 3x3) below): Winograd's F(2x2, 3x3), which computes each
// 2x2 output tile from a 4x4 input tile with 16 products per input-output channel pair instead of 36. Each tile's
// input is transformed (B^T d B), the 16 transformed positions are multiplied by the transformed weights (U = G g G^T,
// 16 sets of panels) with PanelRows, and each tile's 16 results are transformed back (A^T m A), with the bias, the
// residual and the ReLU. Tiles go in chunks whose transformed inputs and products stay in L2, each thread taking
// whole chunks. oneDNN's AVX2 build has no Winograd kernel (oneDNN's are AVX-512 code). Standalone, on ResNet-50's 3x3
// layers at batch 32: 1.4x (56x56, 64 channels) to 2.1x (14x14, 256) oneDNN's direct convolution, the results within
// 1e-5 of its.
// Inference runs F(4x4, 3x3) where the map has enough tiles for it: 4x4 output tiles from 6x6 input tiles, 36 products
// for 16 outputs (2.25 per output against F(2x2, 3x3)'s 4). Its rounding error is larger; training runs it for layers
// with large products only (TrainingWinograd says why), their weight gradient only on AVX-512. With AVX-512 the
// inference runs these layers too: F(4x4, 3x3)'s transforms take whole 16-channel blocks, F(2x2, 3x3)'s read them as
// two halves, and the products run in PanelRows512 and PanelPairRows512.
constexpr int kWinogradBlock = 8, kWinogradPositions = 16;  // F(2x2, 3x3)'s; WinogradShape::positions() in general
constexpr int64_t kWinogradChunkBytes = 300 * 1024;  // a chunk's transformed input and products, per thread
constexpr int64_t kWinogradStreamedWeights = 16 << 20;  // transformed weights past half a 32 MB L3
constexpr int64_t kWinogradMinTiles = 12;            // fewer (a batch of one 4x4 map): direct is faster
// Tiles a chunk of the weight gradient has at least: each chunk reads and writes the thread's (positions, out, in)
// sums (16 positions for F(2x2, 3x3), 36 for F(4x4, 3x3)).
constexpr int64_t kWinogradGradientTiles = 128;
// Training's passes run F(4x4, 3x3) where tiles x in x out is at least this (the weight gradient with AVX-512 only):
// ResNet-50's 3x3 layers at 224x224 (2^24.6 or more at batch 32), not at 32x32 (2^19).
constexpr int64_t kWinogradLargeProducts = int64_t(1) << 23;

// BatchNorm on the batch's statistics of t (dims N, C, H, W, in channel blocks), then a residual block's addition and
// ReLU: mean and (biased) variance per channel, and y = max(0, BatchNorm(t) + residual), in two passes over t (the
// sums, then y), where oneDNN's BatchNorm wrote its output and AddRelu read it back. The statistics are shifted sums
// (each channel's first value as the shift, so that the squares don't cancel where the mean is large against the
// spread); the pool's threads take whole planes of a channel block. Defined with the element-wise passes below, as is
// the AddRelu pass for this CPU (AddReluPass: y = max(0, a + b) over count numbers).
void BatchNormAddRelu(dnnl::threadpool_interop::threadpool_iface &pool, const memory::dims &dims, float eps,
                      const float *t, const float *residual, const float *gamma, const float *beta, float *mean,
                      float *variance, float *y);
using AddReluPassFunction = void (*)(const float *, const float *, float *, int64_t);
AddReluPassFunction AddReluPass();

// Residual blocks' ends whose outputs have at least this many numbers run BatchNormAddRelu: ResNet-50's at 224x224
// (3.2 million or more at batch 32). Smaller ones run oneDNN's BatchNorm and then AddRelu's pass, as before it: its
// statistics round otherwise, and that moves ReLU inputs within rounding of zero to the other side. The whole-network
// gradient parity test (ResNet-18 at 32x32, batch 4: 262,144 numbers or fewer) flipped one with it and holds the
// gradients to torch float64's within 1e-3; ResNet-50's at 32x32 (524,288 or fewer) gained 1.02x from it, side by
// side (4 rounds), and keep oneDNN's with the test's.
constexpr int64_t kFusedBatchNormNumbers = int64_t(1) << 20;

// The three convolutions of a training layer's step.
enum class TrainingPass { kForward, kDataGradient, kWeightGradient };

// Transformed positions of a Winograd tile whose output is tile x tile: (tile + 2)^2 input pixels.
constexpr int64_t WinogradPositions(int64_t tile) { return (tile + 2) * (tile + 2); }

struct WinogradShape {
  int64_t batch, in, out, height, width;  // input and output maps are height x width
  int64_t tile = 2;                       // output tiles are tile x tile: F(2x2, 3x3) or F(4x4, 3x3)
  int64_t tile_rows() const { return (height + tile - 1) / tile; }
  int64_t tile_columns() const { return (width + tile - 1) / tile; }
  int64_t tiles() const { return batch * tile_rows() * tile_columns(); }
  int64_t positions() const { return WinogradPositions(tile); }
};

// Where the 8 channels [8 * group, 8 * group + 8) of `image` start in a map of `channels` channels held in blocks
// of ChannelBlock() (AVX2's 8, or AVX-512's 16, of which a group is one half); its pixels are ChannelBlock()
// floats apart. The Winograd transforms read and write 8 channels at a time either way.
int64_t GroupOffset(int64_t channels, int64_t height, int64_t width, int64_t image, int64_t group) {
  const int64_t block = ChannelBlock(), halves = block / kWinogradBlock;
  return (image * (channels / block) + group / halves) * height * width * block + group % halves * kWinogradBlock;
}

// Whether a 3x3 stride-1 convolution with padding 1 from `in` to `out` channels on these maps, between channel
// blocks, runs WinogradConvolution: whole channel blocks, whole panels of output channels, enough tiles.
bool WinogradUsable(const WinogradShape &s) {
  return s.in % ChannelBlock() == 0 && PanelKernelsUsable(s.out) && s.tiles() >= kWinogradMinTiles;
}

// One 3-tap column (or row) of eight 3x3 kernels through F(4x4, 3x3)'s kernel transform G (6 values each): G's rows
// (1/4, 0, 0), (-1/6, -1/6, -1/6), (-1/6, 1/6, -1/6), (1/24, 1/12, 1/6), (1/24, -1/12, 1/6), (0, 0, 1), as divisions.
__attribute__((target("avx2"), always_inline)) inline void KernelTransform4x4(__m256 w0, __m256 w1, __m256 w2,
                                                                              __m256 out[6]) {
  const __m256 sign = _mm256_set1_ps(-0.0f), six = _mm256_set1_ps(6.0f);
  const __m256 w0_24 = _mm256_div_ps(w0, _mm256_set1_ps(24.0f)), w1_12 = _mm256_div_ps(w1, _mm256_set1_ps(12.0f));
  const __m256 w2_6 = _mm256_div_ps(w2, six);
  out[0] = _mm256_div_ps(w0, _mm256_set1_ps(4.0f));
  out[1] = _mm256_div_ps(_mm256_xor_ps(_mm256_add_ps(_mm256_add_ps(w0, w1), w2), sign), six);
  out[2] = _mm256_div_ps(_mm256_xor_ps(_mm256_add_ps(_mm256_sub_ps(w0, w1), w2), sign), six);
  out[3] = _mm256_add_ps(_mm256_add_ps(w0_24, w1_12), w2_6);
  out[4] = _mm256_add_ps(_mm256_sub_ps(w0_24, w1_12), w2_6);
  out[5] = w2;
}

// The same through F(2x2, 3x3)'s G (4 values each): G's rows (1, 0, 0), (1/2, 1/2, 1/2), (1/2, -1/2, 1/2), (0, 0, 1),
// with the operations, in their order, of the scalar loop this replaced (the transformed weights are the same to the
// bit).
__attribute__((target("avx2"), always_inline)) inline void KernelTransform2x2(__m256 w0, __m256 w1, __m256 w2,
                                                                              __m256 out[4]) {
  const __m256 half = _mm256_set1_ps(0.5f);
  out[0] = w0;
  out[1] = _mm256_mul_ps(half, _mm256_add_ps(_mm256_add_ps(w0, w1), w2));
  out[2] = _mm256_mul_ps(half, _mm256_add_ps(_mm256_sub_ps(w0, w1), w2));
  out[3] = w2;
}

// Eight 3x3 kernels' transforms G g G^T through a kernel transform G of kSide rows (KernelTransform4x4 or
// KernelTransform2x2): w[tap][kernel], taps by rows; position p (kSide x kSide, by rows) of kernel k to
// u[p * stride + k]. Eight kernels a vector because training transforms its weights at every step: scalar, F(4x4,
// 3x3)'s divisions were about 2 % of ResNet-50's step at 224x224, and F(2x2, 3x3)'s loop 0.5-0.7 % of its step at
// 32x32 (perf on Zen 3).
template <int kSide, void (*kTransform)(__m256, __m256, __m256, __m256 *)>
__attribute__((target("avx2"))) void WinogradKernels(const float w[9][8], float *u, int64_t stride) {
  __m256 t[kSide][3];  // G g
  for (int j = 0; j < 3; ++j) {
    __m256 column[kSide];
    kTransform(_mm256_loadu_ps(w[j]), _mm256_loadu_ps(w[3 + j]), _mm256_loadu_ps(w[6 + j]), column);
    for (int r = 0; r < kSide; ++r) t[r][j] = column[r];
  }
  for (int r = 0; r < kSide; ++r) {
    __m256 row[kSide];
    kTransform(t[r][0], t[r][1], t[r][2], row);
    for (int c = 0; c < kSide; ++c) _mm256_storeu_ps(u + (r * kSide + c) * stride, row[c]);
  }
}

// Stores a 64-byte line (a panel row) past the caches: no read of the line first.
__attribute__((target("avx"))) inline void StreamLine(float *to, const float *from) {
  _mm256_stream_ps(to, _mm256_loadu_ps(from));
  _mm256_stream_ps(to + 8, _mm256_loadu_ps(from + 8));
}

// U: (positions, out / 16, in, 16) from OIHW weights g of (out, in) channels, for output tiles of `tile`; with
// data_gradient, of the convolution that computes a 3x3 stride-1 layer's input gradient, whose kernel (o, i) is the
// layer's (i, o) turned by 180 degrees (g then has (in, out) channels). Split over the pool's threads by panels of
// 16 output channels.
void WinogradWeights(dnnl::threadpool_interop::threadpool_iface &pool, const float *g, int64_t out, int64_t in,
                     bool data_gradient, int64_t tile, float *u) {
  // A panel's channels innermost: each input channel's 16 positions are 16 contiguous runs of 16 floats (the
  // input gradient transforms its weights at every training step).
  const int64_t panels = out / kPanelColumns, positions = WinogradPositions(tile);
  // Transformed weights too large to stay in the L3 (layer4's) are stored past the caches: their 16 or 36 streams
  // of stores, each line read from memory before it was written, were half of this function's samples in perf on
  // Zen 3 (training at 224x224), and the products read them from memory either way.
  const bool stream = positions * out * in * static_cast<int64_t>(sizeof(float)) > kWinogradStreamedWeights &&
                      reinterpret_cast<uintptr_t>(u) % 64 == 0;
  const int threads = static_cast<int>(std::min<int64_t>(pool.get_num_threads(), panels));
  pool.parallel_for(threads, [&](int thread, int) {
    for (int64_t panel = panels * thread / threads; panel < panels * (thread + 1) / threads; ++panel) {
      for (int64_t i = 0; i < in; ++i) {
        float rows[WinogradPositions(4)][kPanelColumns];
        const auto kernel = [&](int lane) {
          const int64_t o = panel * kPanelColumns + lane;
          return g + (data_gradient ? i * out + o : o * in + i) * 9;
        };
        if (!data_gradient) {  // the next channels' kernels: one line of each of the panel's 16 kernels
          for (int lane = 0; lane < kPanelColumns; ++lane) {
            PrefetchSpan(reinterpret_cast<uintptr_t>(kernel(lane) + 4 * 9), sizeof(float));
          }
        }
        for (int half = 0; half < kPanelColumns; half += 8) {
          float w[9][8];
          for (int lane = 0; lane < 8; ++lane) {
            for (int tap = 0; tap < 9; ++tap) w[tap][lane] = kernel(half + lane)[data_gradient ? 8 - tap : tap];
          }
          if (tile == 4) {
            WinogradKernels<6, KernelTransform4x4>(w, &rows[0][half], kPanelColumns);
          } else {
            WinogradKernels<4, KernelTransform2x2>(w, &rows[0][half], kPanelColumns);
          }
        }
        for (int position = 0; position < positions; ++position) {
          float *to = u + ((position * panels + panel) * in + i) * kPanelColumns;
          if (stream) {
            StreamLine(to, rows[position]);
          } else {
            std::memcpy(to, rows[position], sizeof(rows[0]));
          }
        }
      }
    }
    if (stream) _mm_sfence();  // the streamed stores reach memory before the pool's threads return
  });
}

// Tiles [first, first + count): v = B^T d B of each tile's 4x4 input (zeros outside the map), as (16, count, in)
// rows, or with panels as (16, in / 16, count, 16) panels of 16 input channels.
__attribute__((target("avx2,fma"))) void WinogradInput(const WinogradShape &s, const float *x, int64_t first,
                                                        int64_t count, bool panels, float *v) {
  const int64_t blocks = s.in / kWinogradBlock, position_stride = count * s.in, pixel = ChannelBlock();
  for (int64_t i = 0; i < count; ++i) {
    const int64_t tile = first + i, image = tile / (s.tile_rows() * s.tile_columns());
    const int64_t top = 2 * (tile / s.tile_columns() % s.tile_rows()) - 1, left = 2 * (tile % s.tile_columns()) - 1;
    for (int64_t block = 0; block < blocks; ++block) {
      const float *plane = x + GroupOffset(s.in, s.height, s.width, image, block);
      // The next tile's new pixels in this block (the 2 columns past this tile's 4), as in WinogradInput4x4:
      // waiting for the loads of x took half of this function's samples in perf on Zen 3 (training at 224x224).
      for (int r = 0; r < 4; ++r) {
        PrefetchSpan(reinterpret_cast<uintptr_t>(plane) + ((top + r) * s.width + left + 4) * pixel * sizeof(float),
                     2 * pixel * sizeof(float));
      }
      __m256 d[4][4];
      for (int r = 0; r < 4; ++r) {
        for (int c = 0; c < 4; ++c) {
          const int64_t row = top + r, column = left + c;
          const bool inside = row >= 0 && row < s.height && column >= 0 && column < s.width;
          d[r][c] = inside ? _mm256_loadu_ps(plane + (row * s.width + column) * pixel) : _mm256_setzero_ps();
        }
      }
      __m256 t[4][4];  // B^T d
      for (int c = 0; c < 4; ++c) {
        t[0][c] = _mm256_sub_ps(d[0][c], d[2][c]);
        t[1][c] = _mm256_add_ps(d[1][c], d[2][c]);
        t[2][c] = _mm256_sub_ps(d[2][c], d[1][c]);
        t[3][c] = _mm256_sub_ps(d[1][c], d[3][c]);
      }
      float *out = panels ? v + ((block / 2) * count + i) * kPanelColumns + (block % 2) * kWinogradBlock
                          : v + i * s.in + block * kWinogradBlock;
      for (int r = 0; r < 4; ++r) {
        _mm256_storeu_ps(out + (r * 4 + 0) * position_stride, _mm256_sub_ps(t[r][0], t[r][2]));
        _mm256_storeu_ps(out + (r * 4 + 1) * position_stride, _mm256_add_ps(t[r][1], t[r][2]));
        _mm256_storeu_ps(out + (r * 4 + 2) * position_stride, _mm256_sub_ps(t[r][2], t[r][1]));
        _mm256_storeu_ps(out + (r * 4 + 3) * position_stride, _mm256_sub_ps(t[r][1], t[r][3]));
      }
    }
  }
}

// y's 2x2 tiles [first, first + count) = A^T m A of their 16 products m (16, count, out), plus the bias (or none), the
// residual (y's layout, or null), then ReLU or not; the map's last row and column where its size is odd dropped.
__attribute__((target("avx2,fma"))) void WinogradOutput(const WinogradShape &s, const float *m, int64_t first,
                                                         int64_t count, const float *bias, const float *residual,
                                                         bool relu, float *y) {
  const int64_t blocks = s.out / kWinogradBlock, position_stride = count * s.out, pixel = ChannelBlock();
  for (int64_t i = 0; i < count; ++i) {
    const int64_t tile = first + i, image = tile / (s.tile_rows() * s.tile_columns());
    const int64_t top = 2 * (tile / s.tile_columns() % s.tile_rows()), left = 2 * (tile % s.tile_columns());
    for (int64_t block = 0; block < blocks; ++block) {
      const float *in = m + i * s.out + block * kWinogradBlock;
      __m256 t[2][4];  // A^T m
      for (int c = 0; c < 4; ++c) {
        const __m256 m0 = _mm256_loadu_ps(in + c * position_stride);
        const __m256 m1 = _mm256_loadu_ps(in + (4 + c) * position_stride);
        const __m256 m2 = _mm256_loadu_ps(in + (8 + c) * position_stride);
        const __m256 m3 = _mm256_loadu_ps(in + (12 + c) * position_stride);
        t[0][c] = _mm256_add_ps(_mm256_add_ps(m0, m1), m2);
        t[1][c] = _mm256_sub_ps(_mm256_sub_ps(m1, m2), m3);
      }
      const __m256 b = bias != nullptr ? _mm256_loadu_ps(bias + block * kWinogradBlock) : _mm256_setzero_ps();
      const int64_t offset = GroupOffset(s.out, s.height, s.width, image, block);
      for (int r = 0; r < 2 && top + r < s.height; ++r) {
        const __m256 pixels[2] = {_mm256_add_ps(_mm256_add_ps(_mm256_add_ps(t[r][0], t[r][1]), t[r][2]), b),
                                  _mm256_add_ps(_mm256_sub_ps(_mm256_sub_ps(t[r][1], t[r][2]), t[r][3]), b)};
        for (int c = 0; c < 2 && left + c < s.width; ++c) {
          const int64_t at = offset + ((top + r) * s.width + left + c) * pixel;
          __m256 value = pixels[c];
          if (residual != nullptr) value = _mm256_add_ps(value, _mm256_loadu_ps(residual + at));
          if (relu) value = _mm256_max_ps(value, _mm256_setzero_ps());
          _mm256_storeu_ps(y + at, value);
        }
      }
    }
  }
}

// F(4x4, 3x3)'s input transform: v (36, count, in) = B^T d B of tiles [first, first + count)'s 6x6 inputs (zeros
// outside the map). B^T's rows: (4, 0, -5, 0, 1, 0), (0, -4, -4, 1, 1, 0), (0, 4, -4, -1, 1, 0),
// (0, -2, -1, 2, 1, 0), (0, 2, -1, -2, 1, 0), (0, 4, 0, -5, 0, 1).
__attribute__((target("avx2,fma"))) inline void InputTransform6(const __m256 e[6], __m256 o[6]) {
  const __m256 two = _mm256_set1_ps(2.0f), four = _mm256_set1_ps(4.0f), five = _mm256_set1_ps(5.0f);
  o[0] = _mm256_fmadd_ps(four, e[0], _mm256_fnmadd_ps(five, e[2], e[4]));
  o[1] = _mm256_fnmadd_ps(four, _mm256_add_ps(e[1], e[2]), _mm256_add_ps(e[3], e[4]));
  o[2] = _mm256_fmadd_ps(four, _mm256_sub_ps(e[1], e[2]), _mm256_sub_ps(e[4], e[3]));
  o[3] = _mm256_fmadd_ps(two, _mm256_sub_ps(e[3], e[1]), _mm256_sub_ps(e[4], e[2]));
  o[4] = _mm256_fnmadd_ps(two, _mm256_sub_ps(e[3], e[1]), _mm256_sub_ps(e[4], e[2]));
  o[5] = _mm256_fmadd_ps(four, e[1], _mm256_fnmadd_ps(five, e[3], e[5]));
}

// InputTransform6 of six vectors `stride` floats apart, each loaded by name: from a loop of loads into an array,
// GCC made a copy of the buffer by 16-byte halves, whose 32-byte reloads missed store-to-load forwarding (a third
// of WinogradInput4x4's and two fifths of WinogradOutput4x4's samples in perf on Zen 3).
__attribute__((target("avx2,fma"))) inline void InputTransform6At(const float *e, int64_t stride, __m256 o[6]) {
  const __m256 values[6] = {_mm256_loadu_ps(e), _mm256_loadu_ps(e + stride), _mm256_loadu_ps(e + 2 * stride),
                            _mm256_loadu_ps(e + 3 * stride), _mm256_loadu_ps(e + 4 * stride),
                            _mm256_loadu_ps(e + 5 * stride)};
  InputTransform6(values, o);
}

__attribute__((target("avx2,fma"))) void WinogradInput4x4(const WinogradShape &s, const float *x, int64_t first,
                                                           int64_t count, float *v) {
  const int64_t blocks = s.in / kWinogradBlock, position_stride = count * s.in, pixel = ChannelBlock();
  for (int64_t i = 0; i < count; ++i) {
    const int64_t tile = first + i, image = tile / (s.tile_rows() * s.tile_columns());
    const int64_t top = 4 * (tile / s.tile_columns() % s.tile_rows()) - 1, left = 4 * (tile % s.tile_columns()) - 1;
    for (int64_t block = 0; block < blocks; ++block) {
      const float *plane = x + GroupOffset(s.in, s.height, s.width, image, block);
      // The next tile's new pixels in this block (the 4 columns past this tile's 6; rows and columns may lie
      // outside the map): waiting for the loads of x took half of this function's samples in perf on Zen 3.
      for (int r = 0; r < 6; ++r) {
        PrefetchSpan(reinterpret_cast<uintptr_t>(plane) + ((top + r) * s.width + left + 6) * pixel * sizeof(float),
                     4 * pixel * sizeof(float));
      }
      alignas(32) float t[6][6][kWinogradBlock];  // B^T d: [row of B^T][column of d]
      for (int c = 0; c < 6; ++c) {
        const int64_t column = left + c;
        const bool column_inside = column >= 0 && column < s.width;
        __m256 d[6], o[6];
        for (int r = 0; r < 6; ++r) {
          const int64_t row = top + r;
          d[r] = column_inside && row >= 0 && row < s.height
                     ? _mm256_loadu_ps(plane + (row * s.width + column) * pixel)
                     : _mm256_setzero_ps();
        }
        InputTransform6(d, o);
        for (int r = 0; r < 6; ++r) _mm256_store_ps(t[r][c], o[r]);
      }
      float *out = v + i * s.in + block * kWinogradBlock;
      for (int r = 0; r < 6; ++r) {
        __m256 o[6];
        InputTransform6At(t[r][0], kWinogradBlock, o);
        for (int c = 0; c < 6; ++c) _mm256_storeu_ps(out + (r * 6 + c) * position_stride, o[c]);
      }
    }
  }
}

// F(4x4, 3x3)'s output transform, A^T's rows (1, 1, 1, 1, 1, 0), (0, 1, -1, 2, -2, 0), (0, 1, 1, 4, 4, 0),
// (0, 1, -1, 8, -8, 1), applied to six values.
__attribute__((target("avx2,fma"))) inline void OutputTransform6(const __m256 m[6], __m256 o[4]) {
  const __m256 two = _mm256_set1_ps(2.0f), four = _mm256_set1_ps(4.0f), eight = _mm256_set1_ps(8.0f);
  const __m256 sum12 = _mm256_add_ps(m[1], m[2]), difference12 = _mm256_sub_ps(m[1], m[2]);
  const __m256 sum34 = _mm256_add_ps(m[3], m[4]), difference34 = _mm256_sub_ps(m[3], m[4]);
  o[0] = _mm256_add_ps(_mm256_add_ps(m[0], sum12), sum34);
  o[1] = _mm256_fmadd_ps(two, difference34, difference12);
  o[2] = _mm256_fmadd_ps(four, sum34, sum12);
  o[3] = _mm256_add_ps(_mm256_fmadd_ps(eight, difference34, difference12), m[5]);
}

// OutputTransform6 of six vectors `stride` floats apart, each loaded by name (as InputTransform6At).
__attribute__((target("avx2,fma"))) inline void OutputTransform6At(const float *m, int64_t stride, __m256 o[4]) {
  const __m256 values[6] = {_mm256_loadu_ps(m), _mm256_loadu_ps(m + stride), _mm256_loadu_ps(m + 2 * stride),
                            _mm256_loadu_ps(m + 3 * stride), _mm256_loadu_ps(m + 4 * stride),
                            _mm256_loadu_ps(m + 5 * stride)};
  OutputTransform6(values, o);
}

// y's 4x4 tiles [first, first + count) = A^T m A of their 36 products m (36, count, out), plus the bias (or none),
// the residual (y's layout, or null), then ReLU or not; rows and columns past the map's edge dropped.
__attribute__((target("avx2,fma"))) void WinogradOutput4x4(const WinogradShape &s, const float *m, int64_t first,
                                                            int64_t count, const float *bias, const float *residual,
                                                            bool relu, float *y) {
  const int64_t blocks = s.out / kWinogradBlock, position_stride = count * s.out, pixel = ChannelBlock();
  for (int64_t i = 0; i < count; ++i) {
    const int64_t tile = first + i, image = tile / (s.tile_rows() * s.tile_columns());
    const int64_t top = 4 * (tile / s.tile_columns() % s.tile_rows()), left = 4 * (tile % s.tile_columns());
    for (int64_t block = 0; block < blocks; ++block) {
      const float *in = m + i * s.out + block * kWinogradBlock;
      alignas(32) float t[4][6][kWinogradBlock];  // A^T m: [row of A^T][column of m]
      for (int c = 0; c < 6; ++c) {
        __m256 o[4];
        OutputTransform6At(in + c * position_stride, 6 * position_stride, o);
        for (int r = 0; r < 4; ++r) _mm256_store_ps(t[r][c], o[r]);
      }
      const __m256 b = bias != nullptr ? _mm256_loadu_ps(bias + block * kWinogradBlock) : _mm256_setzero_ps();
      const int64_t offset = GroupOffset(s.out, s.height, s.width, image, block);
      // The next tile's pixels in this block (the 4 columns past this tile's): the stores to y, waiting for their
      // cache lines, took a third of this function's samples in perf on Zen 3.
      for (int r = 0; r < 4; ++r) {
        PrefetchSpan(reinterpret_cast<uintptr_t>(y + offset) + ((top + r) * s.width + left + 4) * pixel * sizeof(float),
                     4 * pixel * sizeof(float));
      }
      for (int r = 0; r < 4 && top + r < s.height; ++r) {
        __m256 pixels[4];
        OutputTransform6At(t[r][0], kWinogradBlock, pixels);
        for (int c = 0; c < 4 && left + c < s.width; ++c) {
          const int64_t at = offset + ((top + r) * s.width + left + c) * pixel;
          __m256 value = _mm256_add_ps(pixels[c], b);
          if (residual != nullptr) value = _mm256_add_ps(value, _mm256_loadu_ps(residual + at));
          if (relu) value = _mm256_max_ps(value, _mm256_setzero_ps());
          _mm256_storeu_ps(y + at, value);
        }
      }
    }
  }
}

// WinogradInput4x4 and WinogradOutput4x4 on AVX-512's 16-channel blocks: a whole block (one cache line a pixel)
// per vector instead of two halves.
__attribute__((target("avx512f"))) inline void InputTransform6(const __m512 e[6], __m512 o[6]) {
  const __m512 two = _mm512_set1_ps(2.0f), four = _mm512_set1_ps(4.0f), five = _mm512_set1_ps(5.0f);
  o[0] = _mm512_fmadd_ps(four, e[0], _mm512_fnmadd_ps(five, e[2], e[4]));
  o[1] = _mm512_fnmadd_ps(four, _mm512_add_ps(e[1], e[2]), _mm512_add_ps(e[3], e[4]));
  o[2] = _mm512_fmadd_ps(four, _mm512_sub_ps(e[1], e[2]), _mm512_sub_ps(e[4], e[3]));
  o[3] = _mm512_fmadd_ps(two, _mm512_sub_ps(e[3], e[1]), _mm512_sub_ps(e[4], e[2]));
  o[4] = _mm512_fnmadd_ps(two, _mm512_sub_ps(e[3], e[1]), _mm512_sub_ps(e[4], e[2]));
  o[5] = _mm512_fmadd_ps(four, e[1], _mm512_fnmadd_ps(five, e[3], e[5]));
}

__attribute__((target("avx512f"))) inline void OutputTransform6(const __m512 m[6], __m512 o[4]) {
  const __m512 two = _mm512_set1_ps(2.0f), four = _mm512_set1_ps(4.0f), eight = _mm512_set1_ps(8.0f);
  const __m512 sum12 = _mm512_add_ps(m[1], m[2]), difference12 = _mm512_sub_ps(m[1], m[2]);
  const __m512 sum34 = _mm512_add_ps(m[3], m[4]), difference34 = _mm512_sub_ps(m[3], m[4]);
  o[0] = _mm512_add_ps(_mm512_add_ps(m[0], sum12), sum34);
  o[1] = _mm512_fmadd_ps(two, difference34, difference12);
  o[2] = _mm512_fmadd_ps(four, sum34, sum12);
  o[3] = _mm512_add_ps(_mm512_fmadd_ps(eight, difference34, difference12), m[5]);
}

constexpr int kWideBlock = 16;
constexpr int kNarrowBlock = 8;  // AVX2's channel blocks

__attribute__((target("avx512f"))) void WinogradInput4x4Avx512(const WinogradShape &s, const float *x,
                                                                int64_t first, int64_t count, bool panels, float *v) {
  const int64_t blocks = s.in / kWideBlock, position_stride = count * s.in;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t tile = first + i, image = tile / (s.tile_rows() * s.tile_columns());
    const int64_t top = 4 * (tile / s.tile_columns() % s.tile_rows()) - 1, left = 4 * (tile % s.tile_columns()) - 1;
    for (int64_t block = 0; block < blocks; ++block) {
      const float *plane = x + (image * blocks + block) * s.height * s.width * kWideBlock;
      alignas(64) float t[6][6][kWideBlock];  // B^T d: [row of B^T][column of d]
      for (int c = 0; c < 6; ++c) {
        const int64_t column = left + c;
        const bool column_inside = column >= 0 && column < s.width;
        __m512 d[6], o[6];
        for (int r = 0; r < 6; ++r) {
          const int64_t row = top + r;
          d[r] = column_inside && row >= 0 && row < s.height
                     ? _mm512_loadu_ps(plane + (row * s.width + column) * kWideBlock)
                     : _mm512_setzero_ps();
        }
        InputTransform6(d, o);
        for (int r = 0; r < 6; ++r) _mm512_store_ps(t[r][c], o[r]);
      }
      float *out = panels ? v + (block * count + i) * kWideBlock : v + i * s.in + block * kWideBlock;
      for (int r = 0; r < 6; ++r) {
        __m512 e[6], o[6];
        for (int c = 0; c < 6; ++c) e[c] = _mm512_load_ps(t[r][c]);
        InputTransform6(e, o);
        for (int c = 0; c < 6; ++c) _mm512_storeu_ps(out + (r * 6 + c) * position_stride, o[c]);
      }
    }
  }
}

__attribute__((target("avx512f"))) void WinogradOutput4x4Avx512(const WinogradShape &s, const float *m,
                                                                 int64_t first, int64_t count, const float *bias,
                                                                 const float *residual, bool relu, float *y) {
  const int64_t blocks = s.out / kWideBlock, position_stride = count * s.out;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t tile = first + i, image = tile / (s.tile_rows() * s.tile_columns());
    const int64_t top = 4 * (tile / s.tile_columns() % s.tile_rows()), left = 4 * (tile % s.tile_columns());
    for (int64_t block = 0; block < blocks; ++block) {
      const float *in = m + i * s.out + block * kWideBlock;
      alignas(64) float t[4][6][kWideBlock];  // A^T m: [row of A^T][column of m]
      for (int c = 0; c < 6; ++c) {
        __m512 column[6], o[4];
        for (int r = 0; r < 6; ++r) column[r] = _mm512_loadu_ps(in + (r * 6 + c) * position_stride);
        OutputTransform6(column, o);
        for (int r = 0; r < 4; ++r) _mm512_store_ps(t[r][c], o[r]);
      }
      const __m512 b = bias != nullptr ? _mm512_loadu_ps(bias + block * kWideBlock) : _mm512_setzero_ps();
      const int64_t offset = (image * blocks + block) * s.height * s.width * kWideBlock;
      for (int r = 0; r < 4 && top + r < s.height; ++r) {
        __m512 row[6], pixels[4];
        for (int c = 0; c < 6; ++c) row[c] = _mm512_load_ps(t[r][c]);
        OutputTransform6(row, pixels);
        for (int c = 0; c < 4 && left + c < s.width; ++c) {
          const int64_t at = offset + ((top + r) * s.width + left + c) * kWideBlock;
          __m512 value = _mm512_add_ps(pixels[c], b);
          if (residual != nullptr) value = _mm512_add_ps(value, _mm512_loadu_ps(residual + at));
          if (relu) value = _mm512_max_ps(value, _mm512_setzero_ps());
          _mm512_storeu_ps(y + at, value);
        }
      }
    }
  }
}

// y = post(conv3x3(x, g) + bias [+ residual]) with u = WinogradWeights(g) for s.tile; x, y and the residual in
// channel blocks. buffers: two per pool thread (a chunk's transformed input and products).
void WinogradConvolution(dnnl::threadpool_interop::threadpool_iface &pool, const WinogradShape &s, const float *x,
                         const float *u, const float *bias, const float *residual, bool relu, float *y,
                         Buffer *buffers) {
  const int64_t tiles = s.tiles(), threads = pool.get_num_threads(), positions = s.positions();
  const int64_t rows = PanelRowsAtOnce(), panels = s.out / kPanelColumns;
  // AVX-512 on its 16-channel blocks: whole-block transforms (F(4x4, 3x3)) and panels in pairs.
  const bool wide = PanelsAvx512() && ChannelBlock() == kWideBlock;
  // A chunk's tiles: as many as keep its transformed inputs and products in L2. But each chunk reads all the
  // transformed weights, and where they outgrow the L3 (layer4's: 36 MB at F(4x4, 3x3)) that is a stream from
  // memory per chunk: there a chunk takes at least the tiles whose inputs and products weigh half the weights.
  const int64_t tile_bytes = positions * 4 * (s.in + s.out), weight_bytes = positions * 4 * s.in * s.out;
  int64_t fitting = kWinogradChunkBytes / tile_bytes;
  if (weight_bytes > kWinogradStreamedWeights) fitting = std::max(fitting, weight_bytes / (2 * tile_bytes));
  const int64_t most = std::max<int64_t>(rows, fitting / rows * rows);
  // As many chunks as that size needs, rounded up to a multiple of the threads; each thread takes the next chunk
  // when it is done with one, so that a slower core takes fewer (as kPartsPerThread). A tile's result is the same
  // whichever thread computes it.
  const int64_t chunks = ((tiles + most - 1) / most + threads - 1) / threads * threads;
  const int64_t chunk = (tiles + chunks - 1) / chunks;
  const int used = static_cast<int>(std::min(threads, (tiles + chunk - 1) / chunk));
  std::atomic<int64_t> next_first{0};
  pool.parallel_for(used, [&](int thread, int) {
    float *v = static_cast<float *>(buffers[2 * thread].Get(positions * chunk * s.in * sizeof(float)));
    float *m = static_cast<float *>(buffers[2 * thread + 1].Get(positions * chunk * s.out * sizeof(float)));
    for (int64_t first = next_first.fetch_add(chunk); first < tiles; first = next_first.fetch_add(chunk)) {
      const int64_t count = std::min(chunk, tiles - first);
      if (s.tile == 4 && wide) {
        WinogradInput4x4Avx512(s, x, first, count, false, v);
      } else if (s.tile == 4) {
        WinogradInput4x4(s, x, first, count, v);
      } else {
        WinogradInput(s, x, first, count, false, v);
      }
      for (int position = 0; position < positions; ++position) {
        const float *vp = v + position * count * s.in, *up = u + position * s.in * s.out;
        float *mp = m + position * count * s.out;
        for (int64_t panel = 0; panel < panels;) {  // on this thread, no epilogue
          if (wide && panel + 1 < panels) {
            PanelColumnPair(panel, count, s.in, s.out, vp, up, nullptr, nullptr, PostOp::kNone, mp);
            panel += 2;
          } else {
            PanelColumns(panel, count, s.in, s.out, vp, up, nullptr, nullptr, PostOp::kNone, mp);
            panel += 1;
          }
        }
      }
      if (s.tile == 4 && wide) {
        WinogradOutput4x4Avx512(s, m, first, count, bias, residual, relu, y);
      } else if (s.tile == 4) {
        WinogradOutput4x4(s, m, first, count, bias, residual, relu, y);
      } else {
        WinogradOutput(s, m, first, count, bias, residual, relu, y);
      }
    }
  });
}

// The weight gradient of a 3x3 stride-1 layer (padding 1) in Winograd's terms: dW = G^T [sum over tiles of
// (A dY A^T) . (B^T X B)] G, 16 multiplies per channel pair and 2x2 tile against the direct gradient's 36 (F(4x4,
// 3x3) on AVX-512: 36 per 4x4 tile against 144). Each chunk of tiles transforms its inputs (into panels of 16 input
// channels) and its output gradients (zeros outside the map), then adds, for each position, their product over the
// chunk's tiles into the thread's (out, in) sums; the threads' sums are added and turned into 3x3 kernels at the end.
bool WinogradWeightGradientUsable(const WinogradShape &s) {
  return s.out % ChannelBlock() == 0 && PanelKernelsUsable(s.in) && s.tiles() >= kWinogradMinTiles;
}

// Tiles [first, first + count) of dy: z (16, count, out) = A dY A^T of each 2x2 tile (zeros outside the map).
__attribute__((target("avx2,fma"))) void WinogradOutputGradient(const WinogradShape &s, const float *dy,
                                                                 int64_t first, int64_t count, float *z) {
  const int64_t blocks = s.out / kWinogradBlock, position_stride = count * s.out, pixel = ChannelBlock();
  for (int64_t i = 0; i < count; ++i) {
    const int64_t tile = first + i, image = tile / (s.tile_rows() * s.tile_columns());
    const int64_t top = 2 * (tile / s.tile_columns() % s.tile_rows()), left = 2 * (tile % s.tile_columns());
    for (int64_t block = 0; block < blocks; ++block) {
      const float *plane = dy + GroupOffset(s.out, s.height, s.width, image, block);
      // The next tile's pixels in this block (the 2 columns past this tile's): waiting for the loads of dy took
      // four fifths of this function's samples in perf on Zen 3 (training at 224x224).
      for (int r = 0; r < 2; ++r) {
        PrefetchSpan(reinterpret_cast<uintptr_t>(plane) + ((top + r) * s.width + left + 2) * pixel * sizeof(float),
                     2 * pixel * sizeof(float));
      }
      __m256 g[2][2];
      for (int r = 0; r < 2; ++r) {
        for (int c = 0; c < 2; ++c) {
          const bool inside = top + r < s.height && left + c < s.width;
          g[r][c] = inside ? _mm256_loadu_ps(plane + ((top + r) * s.width + left + c) * pixel)
                           : _mm256_setzero_ps();
        }
      }
      __m256 t[4][2];  // A dY
      for (int c = 0; c < 2; ++c) {
        t[0][c] = g[0][c];
        t[1][c] = _mm256_add_ps(g[0][c], g[1][c]);
        t[2][c] = _mm256_sub_ps(g[0][c], g[1][c]);
        t[3][c] = _mm256_sub_ps(_mm256_setzero_ps(), g[1][c]);
      }
      float *out = z + i * s.out + block * kWinogradBlock;
      for (int r = 0; r < 4; ++r) {
        _mm256_storeu_ps(out + (r * 4 + 0) * position_stride, t[r][0]);
        _mm256_storeu_ps(out + (r * 4 + 1) * position_stride, _mm256_add_ps(t[r][0], t[r][1]));
        _mm256_storeu_ps(out + (r * 4 + 2) * position_stride, _mm256_sub_ps(t[r][0], t[r][1]));
        _mm256_storeu_ps(out + (r * 4 + 3) * position_stride, _mm256_sub_ps(_mm256_setzero_ps(), t[r][1]));
      }
    }
  }
}

// dw's kernels (o, i) for output channels [first, last): G^T m G, m the sum of the threads' (16, out, in) sums,
// eight input channels per vector (in is a multiple of 16).
__attribute__((target("avx2,fma"))) void WinogradGradientKernels(const WinogradShape &s,
                                                                  const std::vector<float *> &sums, int64_t first,
                                                                  int64_t last, float *dw) {
  const __m256 half = _mm256_set1_ps(0.5f);
  for (int64_t o = first; o < last; ++o) {
    for (int64_t i = 0; i < s.in; i += kWinogradBlock) {
      __m256 m[4][4];
      for (int position = 0; position < kWinogradPositions; ++position) {
        __m256 total = _mm256_setzero_ps();
        for (const float *sum : sums) {
          total = _mm256_add_ps(total, _mm256_loadu_ps(sum + (position * s.out + o) * s.in + i));
        }
        m[position / 4][position % 4] = total;
      }
      __m256 t[3][4];  // G^T m
      for (int c = 0; c < 4; ++c) {
        t[0][c] = _mm256_add_ps(m[0][c], _mm256_mul_ps(half, _mm256_add_ps(m[1][c], m[2][c])));
        t[1][c] = _mm256_mul_ps(half, _mm256_sub_ps(m[1][c], m[2][c]));
        t[2][c] = _mm256_add_ps(_mm256_mul_ps(half, _mm256_add_ps(m[1][c], m[2][c])), m[3][c]);
      }
      alignas(32) float taps[9][kWinogradBlock];
      for (int r = 0; r < 3; ++r) {
        _mm256_store_ps(taps[r * 3 + 0], _mm256_add_ps(t[r][0], _mm256_mul_ps(half, _mm256_add_ps(t[r][1], t[r][2]))));
        _mm256_store_ps(taps[r * 3 + 1], _mm256_mul_ps(half, _mm256_sub_ps(t[r][1], t[r][2])));
        _mm256_store_ps(taps[r * 3 + 2], _mm256_add_ps(_mm256_mul_ps(half, _mm256_add_ps(t[r][1], t[r][2])), t[r][3]));
      }
      float *kernels = dw + (o * s.in + i) * 9;
      for (int lane = 0; lane < kWinogradBlock; ++lane) {
        for (int tap = 0; tap < 9; ++tap) kernels[lane * 9 + tap] = taps[tap][lane];
      }
    }
  }
}

// F(4x4, 3x3)'s weight gradient on AVX-512's 16-channel blocks: A dY A^T of 4x4 tiles of dY (6x6), A's rows (1, 0,
// 0, 0), (1, 1, 1, 1), (1, -1, 1, -1), (1, 2, 4, 8), (1, -2, 4, -8), (0, 0, 0, 1) (A^T is the forward's output
// transform), then dW = G^T m G with G the forward's kernel transform (KernelTransform4x4).
__attribute__((target("avx512f"))) inline void GradientTransform6(const __m512 g[4], __m512 o[6]) {
  const __m512 two = _mm512_set1_ps(2.0f), four = _mm512_set1_ps(4.0f), eight = _mm512_set1_ps(8.0f);
  const __m512 even = _mm512_add_ps(g[0], g[2]), odd = _mm512_add_ps(g[1], g[3]);
  const __m512 even4 = _mm512_fmadd_ps(four, g[2], g[0]);
  const __m512 odd8 = _mm512_fmadd_ps(eight, g[3], _mm512_mul_ps(two, g[1]));
  o[0] = g[0];
  o[1] = _mm512_add_ps(even, odd);
  o[2] = _mm512_sub_ps(even, odd);
  o[3] = _mm512_add_ps(even4, odd8);
  o[4] = _mm512_sub_ps(even4, odd8);
  o[5] = g[3];
}

// Tiles [first, first + count) of dy: z (36, count, out) = A dY A^T of each 4x4 tile (zeros outside the map).
__attribute__((target("avx512f"))) void WinogradOutputGradient4x4Avx512(const WinogradShape &s, const float *dy,
                                                                         int64_t first, int64_t count, float *z) {
  const int64_t blocks = s.out / kWideBlock, position_stride = count * s.out;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t tile = first + i, image = tile / (s.tile_rows() * s.tile_columns());
    const int64_t top = 4 * (tile / s.tile_columns() % s.tile_rows()), left = 4 * (tile % s.tile_columns());
    for (int64_t block = 0; block < blocks; ++block) {
      const float *plane = dy + (image * blocks + block) * s.height * s.width * kWideBlock;
      alignas(64) float t[6][4][kWideBlock];  // A dY: [row of A][column of dY]
      for (int c = 0; c < 4; ++c) {
        const bool column_inside = left + c < s.width;
        __m512 g[4], o[6];
        for (int r = 0; r < 4; ++r) {
          g[r] = column_inside && top + r < s.height
                     ? _mm512_loadu_ps(plane + ((top + r) * s.width + left + c) * kWideBlock)
                     : _mm512_setzero_ps();
        }
        GradientTransform6(g, o);
        for (int r = 0; r < 6; ++r) _mm512_store_ps(t[r][c], o[r]);
      }
      float *out = z + i * s.out + block * kWideBlock;
      for (int r = 0; r < 6; ++r) {
        __m512 g[4], o[6];
        for (int c = 0; c < 4; ++c) g[c] = _mm512_load_ps(t[r][c]);
        GradientTransform6(g, o);
        for (int c = 0; c < 6; ++c) _mm512_storeu_ps(out + (r * 6 + c) * position_stride, o[c]);
      }
    }
  }
}

// G^T applied to six values: G^T's rows (1/4, -1/6, -1/6, 1/24, 1/24, 0), (0, -1/6, 1/6, 1/12, -1/12, 0),
// (0, -1/6, -1/6, 1/6, 1/6, 1).
__attribute__((target("avx512f"))) inline void KernelGradientTransform6(const __m512 m[6], __m512 o[3]) {
  const __m512 quarter = _mm512_set1_ps(1.0f / 4), sixth = _mm512_set1_ps(1.0f / 6);
  const __m512 twelfth = _mm512_set1_ps(1.0f / 12), twenty_fourth = _mm512_set1_ps(1.0f / 24);
  const __m512 sum12 = _mm512_add_ps(m[1], m[2]), difference12 = _mm512_sub_ps(m[2], m[1]);
  const __m512 sum34 = _mm512_add_ps(m[3], m[4]), difference34 = _mm512_sub_ps(m[3], m[4]);
  o[0] = _mm512_fmadd_ps(quarter, m[0], _mm512_fnmadd_ps(sixth, sum12, _mm512_mul_ps(twenty_fourth, sum34)));
  o[1] = _mm512_fmadd_ps(sixth, difference12, _mm512_mul_ps(twelfth, difference34));
  o[2] = _mm512_fmadd_ps(sixth, _mm512_sub_ps(sum34, sum12), m[5]);
}

// dw's kernels (o, i) for output channels [first, last): G^T m G, m the sum of the threads' (36, out, in) sums,
// sixteen input channels per vector.
__attribute__((target("avx512f"))) void WinogradGradientKernels4x4Avx512(const WinogradShape &s,
                                                                          const std::vector<float *> &sums,
                                                                          int64_t first, int64_t last, float *dw) {
  for (int64_t o = first; o < last; ++o) {
    for (int64_t i = 0; i < s.in; i += kWideBlock) {
      alignas(64) float t[3][6][kWideBlock];  // G^T m: [row of G^T][column of m]
      for (int c = 0; c < 6; ++c) {
        __m512 column[6], out[3];
        for (int r = 0; r < 6; ++r) {
          __m512 total = _mm512_setzero_ps();
          for (const float *sum : sums) {
            total = _mm512_add_ps(total, _mm512_loadu_ps(sum + ((r * 6 + c) * s.out + o) * s.in + i));
          }
          column[r] = total;
        }
        KernelGradientTransform6(column, out);
        for (int r = 0; r < 3; ++r) _mm512_store_ps(t[r][c], out[r]);
      }
      alignas(64) float taps[9][kWideBlock];
      for (int r = 0; r < 3; ++r) {
        __m512 row[6], out[3];
        for (int c = 0; c < 6; ++c) row[c] = _mm512_load_ps(t[r][c]);
        KernelGradientTransform6(row, out);
        for (int c = 0; c < 3; ++c) _mm512_store_ps(taps[r * 3 + c], out[c]);
      }
      float *kernels = dw + (o * s.in + i) * 9;
      for (int lane = 0; lane < kWideBlock; ++lane) {
        for (int tap = 0; tap < 9; ++tap) kernels[lane * 9 + tap] = taps[tap][lane];
      }
    }
  }
}

// dw (OIHW, out x in x 3 x 3) of y = conv3x3(x, w) from dy; x and dy in channel blocks (F(4x4, 3x3): AVX-512's 16).
// buffers: three per pool thread (a chunk's transformed inputs and output gradients, the thread's sums).
void WinogradWeightGradient(dnnl::threadpool_interop::threadpool_iface &pool, const WinogradShape &s,
                            const float *x, const float *dy, float *dw, Buffer *buffers) {
  const int64_t tiles = s.tiles(), threads = pool.get_num_threads(), rows = PanelRowsAtOnce();
  const int64_t positions = s.positions();
  const int64_t most =
      std::max<int64_t>(kWinogradGradientTiles, kWinogradChunkBytes / (positions * 4 * (s.in + s.out)));
  const int64_t chunks = ((tiles + most - 1) / most + threads - 1) / threads * threads;
  const int64_t chunk = (tiles + chunks - 1) / chunks;
  const int used = static_cast<int>(std::min(threads, (tiles + chunk - 1) / chunk));
  const int64_t sums_size = positions * s.out * s.in;
  std::vector<float *> sums(used);
  pool.parallel_for(used, [&](int thread, int) {
    float *v = static_cast<float *>(buffers[3 * thread].Get(positions * chunk * s.in * sizeof(float)));
    float *z = static_cast<float *>(buffers[3 * thread + 1].Get(positions * chunk * s.out * sizeof(float)));
    float *m = static_cast<float *>(buffers[3 * thread + 2].Get(sums_size * sizeof(float)));
    std::fill(m, m + sums_size, 0.0f);
    sums[thread] = m;
    for (int64_t first = thread * chunk; first < tiles; first += used * chunk) {
      const int64_t count = std::min(chunk, tiles - first);
      if (s.tile == 4) {
        WinogradInput4x4Avx512(s, x, first, count, true, v);
        WinogradOutputGradient4x4Avx512(s, dy, first, count, z);
      } else {
        WinogradInput(s, x, first, count, true, v);
        WinogradOutputGradient(s, dy, first, count, z);
      }
      for (int position = 0; position < positions; ++position) {
        const float *zp = z + position * count * s.out, *vp = v + position * count * s.in;
        float *mp = m + position * s.out * s.in;
        for (int64_t panel = 0, panels = s.in / kPanelColumns; panel < panels;) {
          const float *columns = vp + panel * count * kPanelColumns;
          const bool pair = PanelsAvx512() && panel + 1 < panels;  // AVX-512: two panels a call
          for (int64_t row = 0; row < s.out; row += rows) {
            float *sum = mp + row * s.in + panel * kPanelColumns;
            if (pair) {
              PanelPairRowBlock<true>(std::min(rows, s.out - row), zp + row, s.out, columns,
                                      columns + count * kPanelColumns, count, sum, s.in, false, nullptr);
            } else {
              PanelRowBlock<true>(std::min(rows, s.out - row), zp + row, s.out, columns, count, sum, s.in, false,
                                  nullptr);
            }
          }
          panel += pair ? 2 : 1;
        }
      }
    }
  });
  // dw = G^T (the threads' sums) G for each (o, i), split by output channel.
  const int split = static_cast<int>(std::min<int64_t>(threads, s.out));
  pool.parallel_for(split, [&](int thread, int) {
    if (s.tile == 4) {
      WinogradGradientKernels4x4Avx512(s, sums, s.out * thread / split, s.out * (thread + 1) / split, dw);
    } else {
      WinogradGradientKernels(s, sums, s.out * thread / split, s.out * (thread + 1) / split, dw);
    }
  });
}

struct Plan {
  dnnl::primitive primitive;
  memory::desc first_desc, second_desc, result_desc, scratchpad_desc;  // layouts the primitive runs on
  int first_arg, second_arg, result_arg;
};

struct Shape {
  memory::dims src, weights, dst, strides, padding;
};

class Runtime {
 public:
  static Runtime &Get() {
    static Runtime runtime;
    return runtime;
  }

  // Convolution, then BatchNorm on the batch's statistics (training). weights plain; x and y plain or, with
  // x_blocked / y_blocked, in channel blocks (a block-through training step keeps its activations there, and
  // MindSpore's ReLU and addition work on them element by element); conv_out (the convolution's output, kept for
  // the gradient) in channel blocks; mean and (biased) variance per channel. With a residual (y's layout, channel
  // blocks, and no ReLU of the BatchNorm's own), y = max(0, BatchNorm(conv_out) + residual): a residual block's end.
  void ConvBnForward(const Shape &shape, float eps, bool x_blocked, bool y_blocked, bool relu, void *x,
                     void *weights, void *gamma, void *beta, void *y, void *conv_out, void *mean, void *variance,
                     void *relu_mask, const void *residual = nullptr) {
    auto lock = executor_.Begin();
    memory::desc x_plain, w_plain, y_plain;
    PlainDescs(Direction::kForward, shape, &x_plain, &w_plain, &y_plain);
    const memory::desc blocked(shape.dst, memory::data_type::f32, BlockedTag());
    const memory::desc x_desc = x_blocked ? memory::desc(shape.src, memory::data_type::f32, BlockedTag()) : x_plain;
    if (const OnePixelPlan *pixel = GetOnePixelPlan(shape)) {
      OnePixelForward(*pixel, x, weights, conv_out);
    } else if (const GatherPlan *gather = GetGatherPlan(shape, x_desc)) {
      GatherForward(*gather, x, weights, conv_out);
    } else if (const SmallMapPlan *small = GetSmallMapPlan(shape, x_desc)) {
      RunMatmul(small->forward, x, ExpandWeights(*small, weights), conv_out);
    } else if (const auto winograd = TrainingWinograd(shape, TrainingPass::kForward)) {
      WinogradConvolution(executor_.pool, *winograd, InputInBlocks(shape, x_desc, x),
                          TrainingWinogradWeights(*winograd, weights, false), nullptr, nullptr, false,
                          static_cast<float *>(conv_out), winograd_buffers_.get());
    } else {
      const Plan &plan = GetPlan(Direction::kForward, shape);
      Execute(plan, ToLayout(memory(x_desc, engine_, x), plan.first_desc, &buffers_[0]),
              ToLayout(memory(w_plain, engine_, weights), plan.second_desc, &buffers_[1]), blocked, conv_out);
    }
    const int64_t count = shape.dst[0] * shape.dst[1] * shape.dst[2] * shape.dst[3];
    if (residual != nullptr && count >= kFusedBatchNormNumbers) {
      stream_.wait();
      BatchNormAddRelu(executor_.pool, shape.dst, eps, static_cast<const float *>(conv_out),
                       static_cast<const float *>(residual), static_cast<const float *>(gamma),
                       static_cast<const float *>(beta), static_cast<float *>(mean), static_cast<float *>(variance),
                       static_cast<float *>(y));
      return;
    }
    memory out_mem(blocked, engine_, conv_out);
    const BatchNormPlan &norm = GetBatchNormPlan(shape.dst, eps, relu);
    // With a residual, the BatchNorm's output goes to buffers_[4] and AddRelu's pass reads it from there.
    memory normalized(blocked, engine_, y_blocked && residual == nullptr ? y : buffers_[4].Get(blocked.get_size()));
    std::unordered_map<int, memory> args = {{DNNL_ARG_SRC, out_mem},
                                            {DNNL_ARG_DST, normalized},
                                            {DNNL_ARG_MEAN, Channels(shape, mean)},
                                            {DNNL_ARG_VARIANCE, Channels(shape, variance)},
                                            {DNNL_ARG_SCALE, Channels(shape, gamma)},
                                            {DNNL_ARG_SHIFT, Channels(shape, beta)},
                                            {DNNL_ARG_SCRATCHPAD, Scratchpad(norm.forward_scratchpad)}};
    if (relu) args.emplace(DNNL_ARG_WORKSPACE, memory(norm.workspace, engine_, relu_mask));
    norm.forward.execute(stream_, args);
    if (residual != nullptr) {
      stream_.wait();
      const auto pass = AddReluPass();
      const auto *sum = static_cast<const float *>(normalized.get_data_handle());
      ForChunks(count, [&](int64_t begin, int64_t end) {
        pass(sum + begin, static_cast<const float *>(residual) + begin, static_cast<float *>(y) + begin, end - begin);
      });
      return;
    }
    if (!y_blocked) {
      memory y_mem(y_plain, engine_, y);
      dnnl::reorder(normalized, y_mem).execute(stream_, normalized, y_mem);
    }
    stream_.wait();
  }

  // The gradients of ConvBnForward's y: dx (in x's layout), dw (plain OIHW, or as weight_gradient allows the
  // kernel's layout or a window where GradientLayout describes one, recorded in GradientLayouts under weights),
  // dgamma, dbeta, from dy (in y's layout) and the forward's conv_out, mean and variance. d_conv_out_result
  // receives the convolution's output gradient, in channel blocks; with dx null the input gradient is left to
  // ConvBnBackwardData (run only where it is used), which reads it there.
  void ConvBnBackward(const Shape &shape, float eps, bool x_blocked, bool y_blocked, bool relu,
                      WeightGradient weight_gradient, void *dy, void *conv_out, void *mean, void *variance,
                      void *gamma,
                      void *x, void *weights, void *relu_mask, void *dx, void *dw, void *dgamma, void *dbeta,
                      void *d_conv_out_result) {
    auto lock = executor_.Begin();
    memory::desc x_plain, w_plain, y_plain;
    PlainDescs(Direction::kForward, shape, &x_plain, &w_plain, &y_plain);
    const memory::desc blocked(shape.dst, memory::data_type::f32, BlockedTag());
    const memory::desc x_desc = x_blocked ? memory::desc(shape.src, memory::data_type::f32, BlockedTag()) : x_plain;
    const BatchNormPlan &norm = GetBatchNormPlan(shape.dst, eps, relu);
    memory dy_blocked = y_blocked ? memory(blocked, engine_, dy)
                                  : ToLayout(memory(y_plain, engine_, dy), blocked, &buffers_[4]);
    memory d_conv_out(blocked, engine_, d_conv_out_result);
    std::unordered_map<int, memory> args = {{DNNL_ARG_SRC, memory(blocked, engine_, conv_out)},
                                            {DNNL_ARG_DIFF_DST, dy_blocked},
                                            {DNNL_ARG_MEAN, Channels(shape, mean)},
                                            {DNNL_ARG_VARIANCE, Channels(shape, variance)},
                                            {DNNL_ARG_SCALE, Channels(shape, gamma)},
                                            {DNNL_ARG_DIFF_SRC, d_conv_out},
                                            {DNNL_ARG_DIFF_SCALE, Channels(shape, dgamma)},
                                            {DNNL_ARG_DIFF_SHIFT, Channels(shape, dbeta)},
                                            {DNNL_ARG_SCRATCHPAD, Scratchpad(norm.backward_scratchpad)}};
    if (relu) args.emplace(DNNL_ARG_WORKSPACE, memory(norm.workspace, engine_, relu_mask));
    norm.backward.execute(stream_, args);
    if (dx) DataGradient(shape, x_blocked, d_conv_out, weights, dx);
    GradientLayout layout;  // dw's: plain, or as weight_gradient allows, the kernel's ABcd{B}b{B}a or a window
    const bool window = weight_gradient == WeightGradient::kBlocksOrWindow;
    if (const OnePixelPlan *pixel = GetOnePixelPlan(shape)) {
      layout = OnePixelBackwardWeights(*pixel, shape, d_conv_out.get_data_handle(), x, dw, window);
    } else if (const GatherPlan *gather = GetGatherPlan(shape, x_desc)) {
      layout = GatherBackwardWeights(*gather, shape, d_conv_out.get_data_handle(), x, dw, window);
    } else if (const SmallMapPlan *small = GetSmallMapPlan(shape, x_desc)) {
      void *matrix = buffers_[2].Get(small->matrix.get_size());
      RunMatmul(small->backward_weights, d_conv_out.get_data_handle(), x, matrix);
      stream_.wait();
      FoldPixelPairs(small->pairs, static_cast<const float *>(matrix), static_cast<float *>(dw), executor_.pool);
    } else if (const PixelRowsPlan *rows = GetPixelRowsPlan(shape)) {
      PixelRowsBackwardWeights(*rows, d_conv_out, memory(x_desc, engine_, x), dw);
    } else if (const auto winograd = TrainingWinograd(shape, TrainingPass::kWeightGradient)) {
      WinogradWeightGradient(executor_.pool, *winograd, InputInBlocks(shape, x_desc, x),
                             static_cast<const float *>(d_conv_out.get_data_handle()), static_cast<float *>(dw),
                             winograd_gradient_buffers_.get());
    } else {
      // As Run computes it, but from d_conv_out, which is already blocked.
      const Plan &filter = GetPlan(Direction::kBackwardWeights, shape);
      if (weight_gradient != WeightGradient::kPlain) {
        layout.block = KernelLayoutBlock(filter.result_desc, shape.weights);
      }
      Execute(filter, ToLayout(d_conv_out, filter.first_desc, &buffers_[0]),
              ToLayout(memory(x_desc, engine_, x), filter.second_desc, &buffers_[1]),
              layout.block ? filter.result_desc : w_plain, dw);
    }
    stream_.wait();
    if (weight_gradient != WeightGradient::kPlain) GradientLayouts::Record(weights, layout);
  }

  // ConvBnBackward's deferred input gradient: dx (in x's layout) from its d_conv_out_result.
  void ConvBnBackwardData(const Shape &shape, bool x_blocked, void *d_conv_out, void *weights, void *dx) {
    auto lock = executor_.Begin();
    const memory::desc blocked(shape.dst, memory::data_type::f32, BlockedTag());
    DataGradient(shape, x_blocked, memory(blocked, engine_, d_conv_out), weights, dx);
    stream_.wait();
  }

  // Copies a (N, C, H, W) tensor between the plain layout and channel blocks (to_blocked: plain -> blocked).
  void Reorder(const memory::dims &dims, bool to_blocked, void *src, void *dst) {
    auto lock = executor_.Begin();
    const memory::desc plain(dims, memory::data_type::f32, tag::nchw);
    const memory::desc blocked(dims, memory::data_type::f32, BlockedTag());
    memory from(to_blocked ? plain : blocked, engine_, src), to(to_blocked ? blocked : plain, engine_, dst);
    dnnl::reorder(from, to).execute(stream_, from, to);
    stream_.wait();
  }

  // fn(begin, end) over [0, count) in chunks, on the pool's threads (element-wise passes over activations).
  void ForChunks(int64_t count, const std::function<void(int64_t, int64_t)> &fn) {
    constexpr int64_t kChunk = 1 << 16;
    executor_.pool.parallel_for(static_cast<int>((count + kChunk - 1) / kChunk), [&](int chunk, int) {
      fn(chunk * kChunk, std::min(count, (chunk + 1) * kChunk));
    });
  }

  // ReLU then ResNet's stem max pool (training), on channel blocks: y = max(0, the window's maximum), which is
  // the maximum over the ReLU's outputs, and needs ReLU on only a quarter of the numbers. oneDNN's pooling leaves
  // each output's argmax in `workspace` (workspace_bytes long) for the gradient; padding never wins, as in torch.
  void ReluMaxPoolForward(const memory::dims &src_dims, const memory::dims &dst_dims, int kernel, int stride,
                          int padding, void *x, void *y, void *workspace, size_t workspace_bytes) {
    auto lock = executor_.Begin();
    const PoolPlan &plan = GetPoolPlan(src_dims, dst_dims, kernel, stride, padding);
    if (plan.workspace.get_size() > workspace_bytes) {
      throw std::runtime_error("the pooling workspace needs " + std::to_string(plan.workspace.get_size()) +
                               " bytes, got " + std::to_string(workspace_bytes));
    }
    plan.forward.execute(stream_, {{DNNL_ARG_SRC, memory(plan.src, engine_, x)},
                                   {DNNL_ARG_DST, memory(plan.dst, engine_, y)},
                                   {DNNL_ARG_WORKSPACE, memory(plan.workspace, engine_, workspace)},
                                   {DNNL_ARG_SCRATCHPAD, Scratchpad(plan.forward_scratchpad)}});
    stream_.wait();
    float *out = static_cast<float *>(y);
    ForChunks(static_cast<int64_t>(plan.dst.get_size() / sizeof(float)), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) out[i] = out[i] < 0.0f ? 0.0f : out[i];  // keeps NaN, as torch's ReLU
    });
  }

  // ReluMaxPoolForward's input gradient: dy where y > 0 (the ReLU's gradient; written to masked_dy, of y's size),
  // sent by oneDNN to each output's argmax, into dx (channel blocks).
  void ReluMaxPoolBackward(const memory::dims &src_dims, const memory::dims &dst_dims, int kernel, int stride,
                           int padding, void *dy, void *y, void *workspace, void *dx, void *masked_dy) {
    auto lock = executor_.Begin();
    const PoolPlan &plan = GetPoolPlan(src_dims, dst_dims, kernel, stride, padding);
    const float *gradient = static_cast<const float *>(dy), *out = static_cast<const float *>(y);
    float *masked = static_cast<float *>(masked_dy);
    ForChunks(static_cast<int64_t>(plan.dst.get_size() / sizeof(float)), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) masked[i] = out[i] > 0.0f ? gradient[i] : 0.0f;
    });
    plan.backward.execute(stream_, {{DNNL_ARG_DIFF_DST, memory(plan.dst, engine_, masked_dy)},
                                    {DNNL_ARG_DIFF_SRC, memory(plan.src, engine_, dx)},
                                    {DNNL_ARG_WORKSPACE, memory(plan.workspace, engine_, workspace)},
                                    {DNNL_ARG_SCRATCHPAD, Scratchpad(plan.backward_scratchpad)}});
    stream_.wait();
  }

  // Plain-layout pointers in, plain-layout result out: first/second are the two inputs of the direction
  // (forward: src, weights; backward data: diff_dst, weights; backward weights: diff_dst, src).
  void Run(Direction direction, const Shape &shape, void *first, void *second, void *result) {
    auto lock = executor_.Begin();
    const Plan &plan = GetPlan(direction, shape);
    memory::desc first_plain, second_plain, result_plain;
    PlainDescs(direction, shape, &first_plain, &second_plain, &result_plain);
    Execute(plan, ToLayout(memory(first_plain, engine_, first), plan.first_desc, &buffers_[0]),
            ToLayout(memory(second_plain, engine_, second), plan.second_desc, &buffers_[1]), result_plain, result);
    stream_.wait();
  }

 private:
  // Runs plan on inputs already in its layouts and leaves its result in `result`, laid out as result_desc.
  void Execute(const Plan &plan, const memory &first, const memory &second, const memory::desc &result_desc,
               void *result) {
    memory result_user(result_desc, engine_, result);
    memory result_mem = plan.result_desc == result_desc
                            ? result_user
                            : memory(plan.result_desc, engine_, buffers_[2].Get(plan.result_desc.get_size()));
    plan.primitive.execute(stream_, {{plan.first_arg, first},
                                     {plan.second_arg, second},
                                     {plan.result_arg, result_mem},
                                     {DNNL_ARG_SCRATCHPAD, Scratchpad(plan.scratchpad_desc)}});
    if (result_mem.get_data_handle() != result) {
      dnnl::reorder(result_mem, result_user).execute(stream_, result_mem, result_user);
    }
  }

  // The convolution's input gradient dx (in x's layout) from d_conv_out (channel blocks).
  void DataGradient(const Shape &shape, bool x_blocked, const memory &d_conv_out, void *weights, void *dx) {
    if (const OnePixelPlan *pixel = GetOnePixelPlan(shape)) {
      OnePixelBackwardData(*pixel, d_conv_out.get_data_handle(), weights, dx);
      return;
    }
    memory::desc x_plain, w_plain, y_plain;
    PlainDescs(Direction::kForward, shape, &x_plain, &w_plain, &y_plain);
    const memory::desc x_desc = x_blocked ? memory::desc(shape.src, memory::data_type::f32, BlockedTag()) : x_plain;
    if (const GatherPlan *gather = GetGatherPlan(shape, x_desc)) {
      GatherBackwardData(*gather, x_desc, d_conv_out.get_data_handle(), weights, dx);
      return;
    }
    if (const SmallMapPlan *small = GetSmallMapPlan(shape, x_desc)) {
      RunMatmul(small->backward_data, d_conv_out.get_data_handle(), ExpandWeights(*small, weights), dx);
      return;
    }
    if (const auto winograd = TrainingWinograd(shape, TrainingPass::kDataGradient)) {
      const memory::desc blocks(shape.src, memory::data_type::f32, BlockedTag());
      void *result = x_blocked ? dx : buffers_[2].Get(blocks.get_size());
      WinogradConvolution(executor_.pool, *winograd, static_cast<const float *>(d_conv_out.get_data_handle()),
                          TrainingWinogradWeights(*winograd, weights, true), nullptr, nullptr, false,
                          static_cast<float *>(result), winograd_buffers_.get());
      if (!x_blocked) {
        memory from(blocks, engine_, result), to(x_desc, engine_, dx);
        dnnl::reorder(from, to).execute(stream_, from, to);
      }
      return;
    }
    if (TransposedDataGradient(shape)) {
      const bool strided = shape.strides[0] == 2;
      // The forward convolution of d_conv_out with the (in, out) kernels: OIHW weights read transposed. At stride
      // 2 it gives the input gradient at the even pixels, at d_conv_out's size; the others are zeros.
      const memory::dims &y = shape.dst;
      const memory::dims even{shape.src[0], shape.src[1], y[2], y[3]};
      const Shape transposed{y, {shape.weights[1], shape.weights[0], 1, 1}, strided ? even : shape.src,
                             {1, 1}, {0, 0}};
      const memory::desc turned(transposed.weights, memory::data_type::f32,
                                memory::dims{1, shape.weights[1], 1, 1});
      const memory::desc even_desc(even, memory::data_type::f32, BlockedTag());
      void *even_values = strided ? even_pixels_.Get(even_desc.get_size()) : nullptr;
      const Plan &forward = GetPlan(Direction::kForward, transposed);
      Execute(forward, ToLayout(d_conv_out, forward.first_desc, &buffers_[0]),
              ToLayout(memory(turned, engine_, weights), forward.second_desc, &buffers_[1]),
              strided ? even_desc : x_desc, strided ? even_values : dx);
      if (strided) {  // spread on channel blocks, then reordered where x is plain (the same numbers either way)
        stream_.wait();
        const memory::desc blocks(shape.src, memory::data_type::f32, BlockedTag());
        void *spread = x_blocked ? dx : buffers_[2].Get(blocks.get_size());
        SpreadToEvenPixels(executor_.pool, even, shape.src[2], shape.src[3], static_cast<const float *>(even_values),
                           static_cast<float *>(spread));
        if (!x_blocked) {
          memory from(blocks, engine_, spread), to(x_desc, engine_, dx);
          dnnl::reorder(from, to).execute(stream_, from, to);
        }
      }
      return;
    }
    const Plan &data = GetPlan(Direction::kBackwardData, shape);
    Execute(data, ToLayout(d_conv_out, data.first_desc, &buffers_[0]),
            ToLayout(memory(w_plain, engine_, weights), data.second_desc, &buffers_[1]), x_desc, dx);
  }

  // Whether a training layer's input gradient runs as the forward convolution of its output gradient with the
  // kernels transposed (in, out): 1x1 layers with stride 1 or 2 (no padding) on AVX2's 8-channel blocks with at least
  // 128 input channels; at stride 2 the result is the input gradient at the even pixels, spread to them after
  // (SpreadToEvenPixels). Stride 1: oneDNN's AVX2 input-gradient kernel ran 0.97-1.57x slower than its forward
  // kernel on the transposed problem (ResNet-50's shapes, one thread). Stride 2: the forward and the spread ran
  // 1.06-1.61x as fast as that kernel on ResNet-50's three (224x224, batch 32, two threads, Zen 4). On AVX-512's
  // 16-channel blocks the two kernels are one (stride 1), and the detour ran 0.93-0.98x as fast (stride 2).
  static bool TransposedDataGradient(const Shape &shape) {
    const memory::dims &w = shape.weights;
    const bool one_by_one = w[2] == 1 && w[3] == 1 && shape.padding == memory::dims{0, 0} &&
                            (shape.strides == memory::dims{1, 1} || shape.strides == memory::dims{2, 2});
    return ChannelBlock() == 8 && one_by_one && w[1] >= 128 && w[0] % 8 == 0 && w[1] % 8 == 0;
  }

  // Whether shape is a 1x1 convolution with stride 1 and no padding.
  static bool OneByOneStrideOne(const Shape &shape) {
    return shape.weights[2] == 1 && shape.weights[3] == 1 && shape.strides == memory::dims{1, 1} &&
           shape.padding == memory::dims{0, 0};
  }

  // Where a training layer is a 3x3 stride-1 one with padding 1, the Winograd shape its forward (WinogradUsable), its
  // input gradient (the convolution of d_conv_out, in channel blocks, with the layer's kernels turned;
  // WinogradUsable) or its weight gradient (WinogradWeightGradientUsable) runs as; nullopt where not.
  std::optional<WinogradShape> TrainingWinograd(const Shape &shape, TrainingPass pass) const {
    const memory::dims &w = shape.weights, &src = shape.src;
    if (w[2] != 3 || w[3] != 3 || shape.strides != memory::dims{1, 1} || shape.padding != memory::dims{1, 1} ||
        shape.dst != memory::dims{src[0], w[0], src[2], src[3]}) {
      return std::nullopt;
    }
    WinogradShape winograd = pass == TrainingPass::kDataGradient ? WinogradShape{src[0], w[0], w[1], src[2], src[3]}
                                                                 : WinogradShape{src[0], w[1], w[0], src[2], src[3]};
    const auto usable = [pass](const WinogradShape &s) {
      return pass == TrainingPass::kWeightGradient ? WinogradWeightGradientUsable(s) : WinogradUsable(s);
    };
    // The forward runs F(4x4, 3x3) where its products are large (kWinogradLargeProducts), on both ISAs: the step was
    // 1.02-1.05x faster at 224x224 with AVX-512 and 1.05x under the AVX2 cap, and 0.96x at 32x32 with AVX-512
    // (products of 2^19, layer1's 8x8 maps). Elsewhere it stays oneDNN's direct convolution. The forward's rounding
    // decides the ReLUs, and the whole-network gradient parity test (ResNet-18 at 32x32, products of 2^20 or less)
    // holds oneDNN's to torch float64's; an F(2x2, 3x3) forward on AVX2 there had flipped one ReLU (1-18 % off, where
    // oneDNN stays within 3e-4).
    // The input gradient runs F(4x4, 3x3) where its products are large too, and F(2x2, 3x3) elsewhere. On AVX-512's
    // 16-channel blocks so does the weight gradient, with whole-block transforms and paired panels: the step was
    // 1.04x faster at 224x224 than with F(2x2, 3x3)'s input gradient and oneDNN's direct weight gradient, and 0.975x
    // at 32x32. With F(2x2, 3x3) that weight gradient lost what it gained (the step was level), so elsewhere it stays
    // oneDNN's. Under the AVX2 cap the input gradient's F(4x4, 3x3) gave 1.015x at 224x224 (7 rounds side by side);
    // the weight gradient's, with 8-channel transforms, was level with its F(2x2, 3x3) (3 rounds), which it keeps.
    const bool wide = PanelsAvx512() && ChannelBlock() == kWideBlock;
    if (pass != TrainingPass::kWeightGradient || wide) {
      winograd.tile = 4;
      if (winograd.tiles() * winograd.in * winograd.out >= kWinogradLargeProducts && usable(winograd)) return winograd;
      winograd.tile = 2;
      if (pass != TrainingPass::kDataGradient) return std::nullopt;
    } else if (ChannelBlock() != kWinogradBlock) {
      return std::nullopt;
    }
    if (!usable(winograd)) return std::nullopt;
    return winograd;
  }

  // The layer's input x (laid out as x_desc) in channel blocks, for the Winograd passes: x itself where it is there,
  // else reordered into buffers_[1] (and waited for).
  const float *InputInBlocks(const Shape &shape, const memory::desc &x_desc, void *x) {
    const memory blocks = ToLayout(memory(x_desc, engine_, x), memory::desc(shape.src, memory::data_type::f32,
                                                                            BlockedTag()), &buffers_[1]);
    stream_.wait();
    return static_cast<const float *>(blocks.get_data_handle());
  }

  // The layer's plain OIHW weights transformed for a training Winograd convolution, the forward's or (data_gradient)
  // the input gradient's; they change every step, so every call transforms them.
  const float *TrainingWinogradWeights(const WinogradShape &s, void *weights, bool data_gradient) {
    float *u = static_cast<float *>(winograd_weights_.Get(s.positions() * s.in * s.out * sizeof(float)));
    WinogradWeights(executor_.pool, static_cast<const float *>(weights), s.out, s.in, data_gradient, s.tile, u);
    return u;
  }

  Runtime()
      : executor_(Executor::Get()), engine_(executor_.engine), stream_(executor_.stream) {}

  // A matmul and the layouts of its (source, weights, destination) it runs on: 2-D, or where that would run on
  // oneDNN's GEMM, the same product as a batch of column blocks (ColumnBlocks); or SmallMatmul's way to run it.
  struct MatmulPlan {
    dnnl::matmul primitive;
    memory::desc src, weights, dst, scratchpad;
    bool brgemm = false;
    SmallProduct small = SmallProduct::kNone;
  };

  static MatrixView View(const memory::desc &desc, const void *data) {
    const memory::dims dims = desc.get_dims(), strides = desc.get_strides();
    return MatrixView{static_cast<const float *>(data), dims[0], dims[1], strides[0], strides[1]};
  }

  // destination = source x weight_data, as the plan says.
  void RunMatmul(const MatmulPlan &plan, void *source, void *weight_data, void *destination) {
    if (plan.small != SmallProduct::kNone) {
      SmallMatmul(executor_.pool, plan.small, View(plan.src, source), View(plan.weights, weight_data),
                  static_cast<float *>(destination), &matmul_buffers_[0], &matmul_buffers_[1]);
      return;
    }
    plan.primitive.execute(stream_, {{DNNL_ARG_SRC, memory(plan.src, engine_, source)},
                                     {DNNL_ARG_WEIGHTS, memory(plan.weights, engine_, weight_data)},
                                     {DNNL_ARG_DST, memory(plan.dst, engine_, destination)},
                                     {DNNL_ARG_SCRATCHPAD, Scratchpad(plan.scratchpad)}});
  }

  // The plan for src x weights -> dst (2-D, plain strides), or nullopt where oneDNN has only its reference matmul.
  std::optional<MatmulPlan> MakeMatmul(const memory::desc &src, const memory::desc &weights, const memory::desc &dst) {
    const SmallProduct small = SmallProductFor(src, weights, dst);
    if (small != SmallProduct::kNone) return MatmulPlan{{}, src, weights, dst, {}, false, small};
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    auto pd = dnnl::matmul::primitive_desc(engine_, src, weights, dst, attr);
    if (std::strncmp(pd.impl_info_str(), "ref", 3) == 0) return std::nullopt;
    MatmulPlan plan{dnnl::matmul(pd), src, weights, dst, pd.scratchpad_desc(), Brgemm(pd)};
    for (int64_t parts : {2, 4}) {
      if (plan.brgemm || dst.get_dims()[1] % parts != 0) continue;
      const memory::desc batch_src = BatchOfOne(src), batch_weights = ColumnBlocks(weights, parts);
      const memory::desc batch_dst = ColumnBlocks(dst, parts);
      auto split = dnnl::matmul::primitive_desc(engine_, batch_src, batch_weights, batch_dst, attr);
      if (Brgemm(split)) {
        plan = {dnnl::matmul(split), batch_src, batch_weights, batch_dst, split.scratchpad_desc(), true};
      }
    }
    return plan;
  }

  // One-pixel convolutions: a 1x1 input and a 1x1 output (ResNet's layer4 at 32x32 inputs with the ImageNet stem).
  // Only the kernel's centre tap (padding, padding) meets the input, and at 1x1 the channel blocks are the plain
  // (N, C) layout, so the convolution is a matrix product of the (N, I) input with the (O, I) centre tap. oneDNN's
  // matmul runs it on the plain OIHW weights: the blocked convolution's three weight reorders a step (the largest
  // weights of the network) and its kernels for tiny maps go.
  struct OnePixelPlan {
    MatmulPlan forward, backward_data, backward_weights;
    memory::desc forward_weights, backward_data_weights;  // the centre tap as each reads it
    memory::desc centre_io, centre_oi, dw_centre;
    memory::desc centre_io_dense;  // the centre tap as a contiguous (I, O) copy, which CentreTapInOut makes
    int64_t tap = 0;  // offset of the centre tap in each (o, i) run of KH x KW weights
    int64_t taps = 1;
    bool kernel_1x1 = false;
  };

  // The plan for a one-pixel shape, or nullptr where the shape is not one or oneDNN has only its reference
  // matmul for it (then the blocked convolution runs).
  const OnePixelPlan *GetOnePixelPlan(const Shape &shape) {
    const int64_t kh = shape.weights[2], kw = shape.weights[3], pad = shape.padding[0];
    if (shape.src[2] != 1 || shape.src[3] != 1 || shape.dst[2] != 1 || shape.dst[3] != 1 || pad >= kh ||
        pad >= kw || shape.padding[1] != pad) {
      return nullptr;
    }
    auto key = std::make_tuple(shape.src, shape.weights, pad);
    auto found = pixel_plans_.find(key);
    if (found != pixel_plans_.end()) return found->second ? &*found->second : nullptr;
    const int64_t n = shape.src[0], in = shape.src[1], out = shape.weights[0], taps = kh * kw;
    const auto f32 = memory::data_type::f32;
    OnePixelPlan plan;
    plan.tap = pad * kw + pad;
    plan.taps = taps;
    plan.kernel_1x1 = taps == 1;
    plan.centre_io = TapAsInOut(in, out, taps);
    plan.centre_oi = memory::desc({out, in}, f32, memory::dims{in * taps, taps});
    const memory::desc x({n, in}, f32, tag::ab), y({n, out}, f32, tag::ab);
    const memory::desc dy_transposed({out, n}, f32, memory::dims{1, out});
    const memory::desc io({in, out}, f32, tag::ab), oi({out, in}, f32, tag::ab);
    plan.centre_io_dense = io;
    // Forward, y = x . centre^T: on the weights in place where oneDNN has a brgemm kernel for the transposed
    // read, or SmallMatmul runs it (AVX2, a 1x1 kernel: its weights are contiguous (O, I) rows). Else with AVX-512
    // on a contiguous (I, O) copy (its GEMM on the transposed read measured 2-4x slower than the copy), and
    // without, on a copy of the centre tap as contiguous (O, I) rows, which SmallMatmul reads in place (before it,
    // AVX2's GEMM had run (32 x K) x (K x N) products 1.2-1.8x faster so than on (I, O)).
    auto forward = MakeMatmul(x, plan.centre_io, y);
    plan.forward_weights = plan.centre_io;
    if (!forward || !(forward->brgemm || forward->small != SmallProduct::kNone)) {
      const memory::desc rows_read_transposed({in, out}, f32, memory::dims{1, in});
      plan.forward_weights = ChannelBlock() == 16 ? io : rows_read_transposed;
      forward = MakeMatmul(x, plan.forward_weights, y);
    }
    // Backward data, dx = dy . centre: a 1x1 kernel's (O, I) weights are contiguous, a larger one's centre is copied.
    plan.backward_data_weights = plan.kernel_1x1 ? plan.centre_oi : oi;
    auto data = MakeMatmul(y, plan.backward_data_weights, x);
    // Backward weights, dcentre = dy^T . x: into dw itself for a 1x1 kernel, else into a copy that SpreadWindow
    // writes into dw with zeros around it.
    plan.dw_centre = plan.kernel_1x1 ? plan.centre_oi : oi;
    auto filter = MakeMatmul(dy_transposed, x, plan.dw_centre);
    if (!forward || !data || !filter) {
      pixel_plans_.emplace(key, std::nullopt);
      return nullptr;
    }
    plan.forward = *forward, plan.backward_data = *data, plan.backward_weights = *filter;
    return &*pixel_plans_.emplace(key, plan).first->second;
  }

  // The centre tap of OIHW `weights` in `wanted` (the in-place view or a contiguous copy in `buffer`).
  void *CentreTap(const memory::desc &view, const memory::desc &wanted, int64_t tap, void *weights, Buffer *buffer) {
    memory centre(view, engine_, static_cast<float *>(weights) + tap);
    return ToLayout(centre, wanted, buffer).get_data_handle();
  }

  void OnePixelForward(const OnePixelPlan &plan, void *x, void *weights, void *y) {
    void *centre = nullptr;
    if (plan.forward_weights == plan.centre_io_dense) {
      centre = buffers_[1].Get(plan.centre_io_dense.get_size());
      const memory::dims dims = plan.centre_oi.get_dims();
      CentreTapInOut(static_cast<const float *>(weights), dims[0], dims[1], plan.taps, plan.tap,
                     static_cast<float *>(centre));
    } else {
      centre = CentreTap(plan.centre_io, plan.forward_weights, plan.tap, weights, &buffers_[1]);
    }
    RunMatmul(plan.forward, x, centre, y);
  }

  // The centre tap of OIHW weights (out, in, taps) as a contiguous (in, out) matrix: for a block of 16 output
  // channels, each matrix row's cache line of them whole, reading the block's 16 kernel rows side by side.
  // oneDNN's reorder of the strided view ran 1.2-1.3x as long standalone (layer4's 3x3 weights at 32x32, 9.4 MB),
  // and writing one output channel's column at a time (2 KB apart) 1.4x.
  void CentreTapInOut(const float *weights, int64_t out, int64_t in, int64_t taps, int64_t tap, float *io) {
    constexpr int64_t kBlock = 16;  // one cache line of each matrix row
    executor_.pool.parallel_for(static_cast<int>((out + kBlock - 1) / kBlock), [&](int block, int) {
      const int64_t first = block * kBlock, last = std::min(out, first + kBlock);
      for (int64_t i = 0; i < in; ++i) {
        for (int64_t o = first; o < last; ++o) io[i * out + o] = weights[(o * in + i) * taps + tap];
      }
    });
  }

  void OnePixelBackwardData(const OnePixelPlan &plan, void *dy, void *weights, void *dx) {
    void *centre = CentreTap(plan.centre_oi, plan.backward_data_weights, plan.tap, weights, &buffers_[1]);
    RunMatmul(plan.backward_data, dy, centre, dx);
  }

  // dw, plain OIHW; or where `window` allows it and the kernel is larger than 1x1, only the centre tap's
  // gradient, dense (O, I) at dw's start, as the returned layout says.
  GradientLayout OnePixelBackwardWeights(const OnePixelPlan &plan, const Shape &shape, void *dy, void *x, void *dw,
                                         bool window) {
    window = window && !plan.kernel_1x1;
    void *dw_centre = plan.kernel_1x1 || window ? dw : buffers_[2].Get(plan.dw_centre.get_size());
    RunMatmul(plan.backward_weights, dy, x, dw_centre);
    if (window) return {0, 1, 1, plan.tap};
    if (!plan.kernel_1x1) {  // every other tap only ever met padding: its gradient is zero
      stream_.wait();
      SpreadWindow(static_cast<const float *>(dw_centre), shape, 1, 1, static_cast<float *>(dw));
    }
    return {};
  }

  // One-output-pixel convolutions of a larger map: the stride-2 convolutions into layer4 at 32x32 inputs with the
  // ImageNet stem (a 2x2 map into 1x1). The output pixel meets a window of kernel taps, each at one input pixel, so
  // the convolution is a matrix product of the gathered (N, I x taps) input with the (O, I x taps) weights of those
  // taps: oneDNN's convolution kernels ran these shapes at a fraction of its matmul's rate. Columns are ordered
  // (channel, tap row, tap column), as in OIHW and NCHW: where the window is the whole kernel (a 1x1 kernel) the
  // weights and their gradient are the matrix itself, and where it is the whole of a plain input, so is the input.
  struct GatherPlan {
    MatmulPlan forward, backward_data, backward_weights;
    PixelWindow window;
    memory::desc columns, matrix;
    bool copy_x = true, copy_weights = true;  // false: the window is the matrix (no gather, no spreading back)
  };

  // The plan for shape with x in x_desc's layout, or nullptr where the output is not one pixel, the input is (the
  // one-pixel plan), or oneDNN has only its reference matmul for it.
  const GatherPlan *GetGatherPlan(const Shape &shape, const memory::desc &x_desc) {
    if (shape.dst[2] != 1 || shape.dst[3] != 1 || (shape.src[2] == 1 && shape.src[3] == 1)) return nullptr;
    auto key = std::make_tuple(shape.src, shape.weights, shape.padding, IsBlocked(x_desc));
    auto found = gather_plans_.find(key);
    if (found != gather_plans_.end()) return found->second ? &*found->second : nullptr;
    const auto window = OutputPixelWindow(x_desc, shape.weights, shape.dst, shape.padding);
    if (!window) {
      gather_plans_.emplace(key, std::nullopt);
      return nullptr;
    }
    const int64_t n = shape.src[0], out = shape.weights[0], k = shape.src[1] * window->rows * window->cols;
    const auto f32 = memory::data_type::f32;
    GatherPlan plan;
    plan.window = *window;
    plan.copy_x = window->x_view != window->x_dense;
    plan.copy_weights = window->w_view != window->w_dense;
    plan.columns = memory::desc({n, k}, f32, tag::ab);
    plan.matrix = memory::desc({out, k}, f32, tag::ab);
    const memory::desc matrix_transposed({k, out}, f32, memory::dims{1, k}), y({n, out}, f32, tag::ab);
    const memory::desc dy_transposed({out, n}, f32, memory::dims{1, out});
    auto forward = MakeMatmul(plan.columns, matrix_transposed, y);
    auto data = MakeMatmul(y, plan.matrix, plan.columns);
    auto filter = MakeMatmul(dy_transposed, plan.columns, plan.matrix);
    if (!forward || !data || !filter) {
      gather_plans_.emplace(key, std::nullopt);
      return nullptr;
    }
    plan.forward = *forward, plan.backward_data = *data, plan.backward_weights = *filter;
    return &*gather_plans_.emplace(key, plan).first->second;
  }

  // Training's plan for convolutions where every output pixel meets every input pixel (PixelPairs), x and y in
  // channel blocks: y = x . matrix^T, dx = dy . matrix, dmatrix = dy^T . x, folded into dw.
  struct SmallMapPlan {
    MatmulPlan forward, backward_data, backward_weights;
    memory::desc matrix;  // (rows, columns)
    PixelPairs pairs;
  };

  // The plan for shape with x in channel blocks (x_desc), or nullptr where AllPixelPairs finds none or oneDNN has
  // only its reference matmul for it.
  const SmallMapPlan *GetSmallMapPlan(const Shape &shape, const memory::desc &x_desc) {
    if (!IsBlocked(x_desc)) return nullptr;
    auto key = std::make_tuple(shape.src, shape.weights, shape.dst, shape.strides, shape.padding);
    auto found = small_map_plans_.find(key);
    if (found != small_map_plans_.end()) return found->second ? &*found->second : nullptr;
    const auto pairs = AllPixelPairs(shape.src, shape.weights, shape.dst, shape.strides, shape.padding,
                                     ChannelBlock(), ChannelBlock());
    std::optional<MatmulPlan> forward, data, filter;
    const int64_t n = shape.src[0];
    const auto f32 = memory::data_type::f32;
    memory::desc matrix;
    if (pairs) {
      const int64_t k = pairs->columns(), rows = pairs->rows();
      matrix = memory::desc({rows, k}, f32, tag::ab);
      const memory::desc x({n, k}, f32, tag::ab), y({n, rows}, f32, tag::ab);
      forward = MakeMatmul(x, memory::desc({k, rows}, f32, memory::dims{1, k}), y);
      data = MakeMatmul(y, matrix, x);
      filter = MakeMatmul(memory::desc({rows, n}, f32, memory::dims{1, rows}), x, matrix);
    }
    if (!forward || !data || !filter) {
      small_map_plans_.emplace(key, std::nullopt);
      return nullptr;
    }
    return &*small_map_plans_.emplace(key, SmallMapPlan{*forward, *data, *filter, matrix, *pairs}).first->second;
  }

  // Weight gradients of 1x1 stride-1 convolutions on small maps with AVX-512 (layer3's 2x2 maps at 32x32 inputs):
  // dw (O, I) = dy^T . x, one matrix product over the batch's pixels, dy and x copied into NHWC rows. On a Zen 4, in
  // ResNet-50's training step at batch 32, oneDNN's jit_1x1 weight-gradient kernel ran layer3's shapes at 51-85
  // GFLOP/s (its forward at 146-163): 20.9 ms a step for the 1x1 layers' weight gradients became 8.1 with 2.7 ms
  // more of matrix products (oneDNN's log). On 4x4 maps the products cost more than they saved; under AVX2 oneDNN's
  // GEMM ran the 2x2 maps' products at its jit_1x1 kernel's speed, so there it runs as before.
  static constexpr int64_t kPixelRowsPixels = 4;  // the largest map's pixels
  struct PixelRowsPlan {
    MatmulPlan backward_weights;
    memory::desc x_rows, dy_rows;  // x and dy in NHWC: (N x H x W, I) and (N x H x W, O) rows
  };

  // The plan for shape, or nullptr without AVX-512, where shape is not a 1x1 stride-1 convolution on at most
  // kPixelRowsPixels pixels, or where oneDNN has only its reference matmul for it.
  const PixelRowsPlan *GetPixelRowsPlan(const Shape &shape) {
    if (ChannelBlock() != kWideBlock || !OneByOneStrideOne(shape) || shape.src[2] * shape.src[3] > kPixelRowsPixels) {
      return nullptr;
    }
    auto key = std::make_tuple(shape.src, shape.weights);
    auto found = pixel_rows_plans_.find(key);
    if (found != pixel_rows_plans_.end()) return found->second ? &*found->second : nullptr;
    const int64_t rows = shape.src[0] * shape.src[2] * shape.src[3], in = shape.src[1], out = shape.weights[0];
    const auto f32 = memory::data_type::f32;
    auto filter = MakeMatmul(memory::desc({out, rows}, f32, memory::dims{1, out}),
                             memory::desc({rows, in}, f32, tag::ab), memory::desc({out, in}, f32, tag::ab));
    if (!filter) {
      pixel_rows_plans_.emplace(key, std::nullopt);
      return nullptr;
    }
    const PixelRowsPlan plan{*filter, memory::desc(shape.src, f32, tag::nhwc), memory::desc(shape.dst, f32, tag::nhwc)};
    return &*pixel_rows_plans_.emplace(key, plan).first->second;
  }

  // dw (plain OIHW) from d_conv_out and x in any layout.
  void PixelRowsBackwardWeights(const PixelRowsPlan &plan, const memory &d_conv_out, const memory &x, void *dw) {
    void *dy_rows = ToLayout(d_conv_out, plan.dy_rows, &buffers_[0]).get_data_handle();
    void *x_rows = ToLayout(x, plan.x_rows, &buffers_[1]).get_data_handle();
    stream_.wait();
    RunMatmul(plan.backward_weights, dy_rows, x_rows, dw);
  }

  // The plan's matrix from OIHW weights, in buffers_[1].
  void *ExpandWeights(const SmallMapPlan &plan, void *weights) {
    float *matrix = static_cast<float *>(buffers_[1].Get(plan.matrix.get_size()));
    ExpandPixelPairs(plan.pairs, static_cast<const float *>(weights), matrix, executor_.pool);
    return matrix;
  }

  static bool IsBlocked(const memory::desc &desc) { return desc.get_inner_nblks() > 0; }

  // `from` (laid out as from_desc) copied into `to` (as to_desc).
  void Copy(const memory::desc &from_desc, void *from, const memory::desc &to_desc, void *to) {
    memory source(from_desc, engine_, from), target(to_desc, engine_, to);
    dnnl::reorder(source, target).execute(stream_, source, target);
  }

  // The gathered input (N, I x taps), in `buffer` where it is not x itself.
  void *GatherInput(const GatherPlan &plan, void *x, Buffer *buffer) {
    if (!plan.copy_x) return x;
    void *columns = buffer->Get(plan.columns.get_size());
    Copy(plan.window.x_view, x, plan.window.x_dense, columns);
    return columns;
  }

  // The window's weights as the (O, I x taps) matrix, in buffers_[1] where they are not the weights themselves.
  void *GatherWeights(const GatherPlan &plan, void *weights) {
    if (!plan.copy_weights) return weights;
    void *matrix = buffers_[1].Get(plan.matrix.get_size());
    Copy(plan.window.w_view, weights, plan.window.w_dense, matrix);
    return matrix;
  }

  void GatherForward(const GatherPlan &plan, void *x, void *weights, void *y) {
    void *columns = GatherInput(plan, x, &buffers_[0]);
    void *matrix = GatherWeights(plan, weights);
    RunMatmul(plan.forward, columns, matrix, y);
  }

  // dx in x_desc's layout: the columns' gradient spread back over the window, zero elsewhere.
  void GatherBackwardData(const GatherPlan &plan, const memory::desc &x_desc, void *dy, void *weights, void *dx) {
    void *matrix = GatherWeights(plan, weights);
    void *columns = plan.copy_x ? buffers_[0].Get(plan.columns.get_size()) : dx;
    RunMatmul(plan.backward_data, dy, matrix, columns);
    if (!plan.copy_x) return;
    stream_.wait();
    std::memset(dx, 0, x_desc.get_size());
    Copy(plan.window.x_dense, columns, plan.window.x_view, dx);
  }

  // dw, plain OIHW: the matrix's gradient spread back over the window of taps, zero elsewhere; or where `window`
  // allows it and the window is not the whole kernel, only the window's taps, dense (O, I, rows, cols) at dw's
  // start, as the returned layout says.
  GradientLayout GatherBackwardWeights(const GatherPlan &plan, const Shape &shape, void *dy, void *x, void *dw,
                                       bool window) {
    void *columns = GatherInput(plan, x, &buffers_[0]);
    window = window && plan.copy_weights;
    void *matrix = plan.copy_weights && !window ? buffers_[2].Get(plan.matrix.get_size()) : dw;
    RunMatmul(plan.backward_weights, dy, columns, matrix);
    const int64_t pad = shape.padding[0];  // the window's first tap, as SpreadWindow places it
    if (window) return {0, plan.window.rows, plan.window.cols, pad * shape.weights[3] + pad};
    if (!plan.copy_weights) return {};
    stream_.wait();
    SpreadWindow(static_cast<const float *>(matrix), shape, plan.window.rows, plan.window.cols,
                 static_cast<float *>(dw));
    return {};
  }

  // The OIHW weight gradient dw of a one-output-pixel layer from its window's taps, dense (O, I, rows, cols): the
  // window starts at tap (pad, pad) of each kernel (OutputPixelWindow), the other taps only ever met padding and
  // get zeros. One pass over dw on the pool's threads, a cache-sized run of kernels at a time: zeroing all of dw on
  // one thread, then scattering the window into it, had made these calls (layer4's 3x3 layers at 32x32, megabytes
  // of weights each) 1.3-1.8x as long.
  void SpreadWindow(const float *window, const Shape &shape, int64_t rows, int64_t cols, float *dw) {
    const int64_t kh = shape.weights[2], kw = shape.weights[3], pad = shape.padding[0];
    constexpr int64_t kKernelsInCache = 4096;  // zeroed, then the window written while they are in L2
    const GradientLayout layout{0, rows, cols, pad * kw + pad};
    ForChunks(shape.weights[0] * shape.weights[1], [&](int64_t begin, int64_t end) {
      for (int64_t first = begin; first < end; first += kKernelsInCache) {
        const int64_t count = std::min(end, first + kKernelsInCache) - first;
        WindowToKernels(layout, window, first, count, kh * kw, kw, dw + first * kh * kw);
      }
    });
  }

  static void PlainDescs(Direction direction, const Shape &shape, memory::desc *first, memory::desc *second,
                         memory::desc *result) {
    memory::desc src(shape.src, memory::data_type::f32, tag::nchw);
    memory::desc weights(shape.weights, memory::data_type::f32, tag::oihw);
    memory::desc dst(shape.dst, memory::data_type::f32, tag::nchw);
    if (direction == Direction::kForward) {
      *first = src, *second = weights, *result = dst;
    } else if (direction == Direction::kBackwardData) {
      *first = dst, *second = weights, *result = src;
    } else {
      *first = dst, *second = src, *result = weights;
    }
  }

  struct PoolPlan {
    dnnl::pooling_forward forward;
    dnnl::pooling_backward backward;
    memory::desc src, dst, workspace, forward_scratchpad, backward_scratchpad;
  };

  // Max pooling for training on channel blocks, with the workspace its gradient reads.
  const PoolPlan &GetPoolPlan(const memory::dims &src_dims, const memory::dims &dst_dims, int kernel, int stride,
                              int padding) {
    auto key = std::make_tuple(src_dims, dst_dims, kernel, stride, padding);
    auto found = pools_.find(key);
    if (found != pools_.end()) return found->second;
    const memory::desc src(src_dims, memory::data_type::f32, BlockedTag());
    const memory::desc dst(dst_dims, memory::data_type::f32, BlockedTag());
    const memory::dims padding_r = PoolingPaddingR(src_dims, dst_dims, kernel, stride, padding);
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    auto forward = dnnl::pooling_forward::primitive_desc(
        engine_, dnnl::prop_kind::forward_training, dnnl::algorithm::pooling_max, src, dst, {stride, stride},
        {kernel, kernel}, {0, 0}, {padding, padding}, padding_r, attr);
    auto backward = dnnl::pooling_backward::primitive_desc(
        engine_, dnnl::algorithm::pooling_max, src, dst, {stride, stride}, {kernel, kernel}, {0, 0},
        {padding, padding}, padding_r, forward, attr);
    PoolPlan plan{dnnl::pooling_forward(forward), dnnl::pooling_backward(backward), src, dst,
                  forward.workspace_desc(), forward.scratchpad_desc(), backward.scratchpad_desc()};
    return pools_.emplace(key, plan).first->second;
  }

  struct BatchNormPlan {
    dnnl::batch_normalization_forward forward;
    dnnl::batch_normalization_backward backward;
    memory::desc forward_scratchpad, backward_scratchpad;
    memory::desc workspace;  // with relu: which outputs the ReLU zeroed (a bit each), for the gradient
  };

  // BatchNorm with scale and shift on the batch's statistics, on channel blocks; with relu, ReLU fused into it
  // (oneDNN's fuse_norm_relu: the output is ReLU's, and the gradient is masked as it goes).
  const BatchNormPlan &GetBatchNormPlan(const memory::dims &dims, float eps, bool relu) {
    auto key = std::make_tuple(dims, eps, relu);
    auto found = norms_.find(key);
    if (found != norms_.end()) return found->second;
    const memory::desc blocked(dims, memory::data_type::f32, BlockedTag());
    auto flags = dnnl::normalization_flags::use_scale | dnnl::normalization_flags::use_shift;
    if (relu) flags = flags | dnnl::normalization_flags::fuse_norm_relu;
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    auto forward = dnnl::batch_normalization_forward::primitive_desc(
        engine_, dnnl::prop_kind::forward_training, blocked, blocked, eps, flags, attr);
    auto backward = dnnl::batch_normalization_backward::primitive_desc(
        engine_, dnnl::prop_kind::backward, blocked, blocked, blocked, eps, flags, forward, attr);
    BatchNormPlan plan{dnnl::batch_normalization_forward(forward), dnnl::batch_normalization_backward(backward),
                       forward.scratchpad_desc(), backward.scratchpad_desc(), forward.workspace_desc()};
    return norms_.emplace(key, plan).first->second;
  }

  memory Channels(const Shape &shape, void *data) {
    return memory(memory::desc({shape.dst[1]}, memory::data_type::f32, tag::a), engine_, data);
  }

  memory Scratchpad(const memory::desc &desc) { return memory(desc, engine_, buffers_[3].Get(desc.get_size())); }

  memory ToLayout(const memory &plain, const memory::desc &wanted, Buffer *buffer) {
    if (plain.get_desc() == wanted) return plain;
    memory converted(wanted, engine_, buffer->Get(wanted.get_size()));
    if (const int64_t block = TransposedBlocks(plain.get_desc(), wanted)) {
      stream_.wait();  // the buffer may still be read by the stream's last primitive
      const auto *from = static_cast<const float *>(plain.get_data_handle());
      auto *to = static_cast<float *>(converted.get_data_handle());
      const memory::dims dims = wanted.get_dims();
      if (block == kWideBlock) {
        CopyToTransposedBlocks<kWideBlock>(from, dims[0], dims[1], to);
      } else {  // the wanted dims are (I, O): the plain weights' (O, I) read transposed
        CopyToTransposedBlocks<kNarrowBlock>(from, dims[1], dims[0], to);
      }
      return converted;
    }
    dnnl::reorder(plain, converted).execute(stream_, const_cast<memory &>(plain), converted);
    return converted;
  }

  // The block B where `to` holds plain 1x1 OIHW weights (O, I) as (I/B, O/B) tiles of B output channels' runs of B
  // consecutive input channels, else 0. Two such pairs: the weights as they are into BAcd16a16b, the layout of
  // oneDNN's 1x1 data-gradient kernels with AVX-512; and under AVX2, where a 1x1 layer's input gradient runs as the
  // forward convolution with the kernels transposed (TransposedDataGradient), the weights read as (I, O) into that
  // convolution's ABcd8b8a: the same tiles with B = 8.
  static int64_t TransposedBlocks(const memory::desc &from, const memory::desc &to) {
    const memory::dims dims = to.get_dims();
    const auto f32 = memory::data_type::f32;
    if (dims.size() != 4 || dims[2] != 1 || dims[3] != 1) return 0;
    if (dims[0] % kWideBlock == 0 && dims[1] % kWideBlock == 0 && from == memory::desc(dims, f32, tag::abcd) &&
        to == memory::desc(dims, f32, tag::BAcd16a16b)) {
      return kWideBlock;
    }
    const memory::desc read_transposed(dims, f32, memory::dims{1, dims[0], 1, 1});
    if (dims[0] % kNarrowBlock == 0 && dims[1] % kNarrowBlock == 0 && from == read_transposed &&
        to == memory::desc(dims, f32, tag::ABcd8b8a)) {
      return kNarrowBlock;
    }
    return 0;
  }

  // Plain 1x1 OIHW weights (out, in) as (in/B, out/B) tiles, each B rows (output channels) of B consecutive input
  // channels, so every run of B numbers is copied whole, one output channel's row at a time. oneDNN's reorders took
  // 1.2-2x as long standalone with B = 16 (the largest weight reorders of a training step at 32x32), and 1.0-1.5x as
  // long in the step with B = 8 (each call timed there, in an ad-hoc build). Copying a cache line's worth of columns
  // of every row at a time instead, each part's tiles written front to back, was 1.3-2.8x faster than the reorders
  // standalone but 1.4-1.8x slower in the step: not kept.
  template <int64_t block>
  void CopyToTransposedBlocks(const float *plain, int64_t out, int64_t in, float *tiles) {
    const int64_t row_blocks = out / block;
    executor_.pool.parallel_for(static_cast<int>(row_blocks), [&](int row_block, int) {
      for (int64_t o = row_block * block; o < (row_block + 1) * block; ++o) {
        const float *row = plain + o * in;
        float *first_tile = tiles + row_block * block * block + (o % block) * block;
        for (int64_t column_block = 0; column_block < in / block; ++column_block) {
          std::memcpy(first_tile + column_block * row_blocks * block * block, row + column_block * block,
                      block * sizeof(float));  // a constant size: inlined as vector moves
        }
      }
    });
  }

  // Training keeps activations in channel blocks. Where oneDNN picks another layout for a data gradient (its NHWC
  // kernels for stride 2 under AVX2), each call would reorder the output gradient there and the input gradient
  // back, through buffers as large as the largest activation: the plan on channel blocks instead, where oneDNN has
  // a jit kernel for them (standalone, AVX2's blocked kernels ran those shapes at the same speed or faster).
  std::optional<dnnl::convolution_backward_data::primitive_desc> BlockedBackwardData(
      const Shape &shape, const dnnl::convolution_backward_data::primitive_desc &chosen,
      const dnnl::primitive_attr &attr) {
    const memory::desc src(shape.src, memory::data_type::f32, BlockedTag());
    const memory::desc dst(shape.dst, memory::data_type::f32, BlockedTag());
    if ((chosen.diff_src_desc() == src && chosen.diff_dst_desc() == dst) || shape.src[1] % ChannelBlock() != 0 ||
        shape.dst[1] % ChannelBlock() != 0) {
      return std::nullopt;
    }
    const memory::desc weights(shape.weights, memory::data_type::f32, tag::any);
    try {
      auto forward = dnnl::convolution_forward::primitive_desc(
          engine_, dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct, src, weights, dst,
          shape.strides, shape.padding, shape.padding, attr);
      auto blocked = dnnl::convolution_backward_data::primitive_desc(
          engine_, dnnl::algorithm::convolution_direct, src, weights, dst, shape.strides, shape.padding,
          shape.padding, forward, attr);
      const std::string kernel = blocked.impl_info_str();
      if (kernel.find("ref") == std::string::npos && kernel.find("gemm") == std::string::npos) return blocked;
    } catch (const dnnl::error &) {
    }
    return std::nullopt;
  }

  const Plan &GetPlan(Direction direction, const Shape &shape) {
    auto key = std::make_tuple(static_cast<int>(direction), shape.src, shape.weights, shape.dst, shape.strides,
                               shape.padding);
    auto found = plans_.find(key);
    if (found != plans_.end()) return found->second;
    memory::desc src(shape.src, memory::data_type::f32, tag::any);
    memory::desc weights(shape.weights, memory::data_type::f32, tag::any);
    memory::desc dst(shape.dst, memory::data_type::f32, tag::any);
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    auto forward = dnnl::convolution_forward::primitive_desc(
        engine_, dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct, src, weights, dst,
        shape.strides, shape.padding, shape.padding, attr);
    Plan plan;
    if (direction == Direction::kForward) {
      plan = {dnnl::convolution_forward(forward), forward.src_desc(), forward.weights_desc(), forward.dst_desc(),
              forward.scratchpad_desc(), DNNL_ARG_SRC, DNNL_ARG_WEIGHTS, DNNL_ARG_DST};
    } else if (direction == Direction::kBackwardData) {
      auto backward = dnnl::convolution_backward_data::primitive_desc(
          engine_, dnnl::algorithm::convolution_direct, src, weights, dst, shape.strides, shape.padding,
          shape.padding, forward, attr);
      if (auto blocked = BlockedBackwardData(shape, backward, attr)) backward = *blocked;
      plan = {dnnl::convolution_backward_data(backward), backward.diff_dst_desc(), backward.weights_desc(),
              backward.diff_src_desc(), backward.scratchpad_desc(), DNNL_ARG_DIFF_DST, DNNL_ARG_WEIGHTS,
              DNNL_ARG_DIFF_SRC};
    } else {
      auto backward = dnnl::convolution_backward_weights::primitive_desc(
          engine_, dnnl::algorithm::convolution_direct, src, weights, dst, shape.strides, shape.padding,
          shape.padding, forward, attr);
      plan = {dnnl::convolution_backward_weights(backward), backward.diff_dst_desc(), backward.src_desc(),
              backward.diff_weights_desc(), backward.scratchpad_desc(), DNNL_ARG_DIFF_DST, DNNL_ARG_SRC,
              DNNL_ARG_DIFF_WEIGHTS};
    }
    return plans_.emplace(key, plan).first->second;
  }

  Executor &executor_;
  dnnl::engine &engine_;
  dnnl::stream &stream_;
  Buffer buffers_[5];  // first input, second input, result, scratchpad; ConvBn's blocked y or dy
  Buffer winograd_weights_;  // a layer's weights transformed for WinogradConvolution
  Buffer matmul_buffers_[2];  // SmallMatmul's panels and transposed product
  Buffer even_pixels_;  // a stride-2 1x1 layer's input gradient at the even pixels (TransposedDataGradient)
  std::unique_ptr<Buffer[]> winograd_buffers_{new Buffer[2 * static_cast<size_t>(executor_.pool.get_num_threads())]};
  std::unique_ptr<Buffer[]> winograd_gradient_buffers_{
      new Buffer[3 * static_cast<size_t>(executor_.pool.get_num_threads())]};
  std::map<std::tuple<int, memory::dims, memory::dims, memory::dims, memory::dims, memory::dims>, Plan> plans_;
  std::map<std::tuple<memory::dims, float, bool>, BatchNormPlan> norms_;
  std::map<std::tuple<memory::dims, memory::dims, int, int, int>, PoolPlan> pools_;
  std::map<std::tuple<memory::dims, memory::dims, int64_t>, std::optional<OnePixelPlan>> pixel_plans_;
  std::map<std::tuple<memory::dims, memory::dims, memory::dims, bool>, std::optional<GatherPlan>> gather_plans_;
  std::map<std::tuple<memory::dims, memory::dims, memory::dims, memory::dims, memory::dims>,
           std::optional<SmallMapPlan>>
      small_map_plans_;
  std::map<std::tuple<memory::dims, memory::dims>, std::optional<PixelRowsPlan>> pixel_rows_plans_;
};

// Memory layouts of inference activations, as Python numbers them. MindSpore sees an NHWC tensor as (N, H, W, C)
// and the other two as (N, C, H, W); a blocked tensor (nChw16c or nChw8c) is that many floats in channel blocks
// of ChannelBlock().
enum class Layout : int64_t { kNhwc = 0, kNchw = 1, kBlocked = 2 };

tag LayoutTag(Layout layout) {
  return layout == Layout::kNhwc ? tag::nhwc : layout == Layout::kNchw ? tag::nchw : BlockedTag();
}

// Inference primitives' attributes: the residual addition (a tensor shaped as dst) and ReLU as post-ops, and the
// scratchpad passed in by the caller.
dnnl::primitive_attr InferenceAttr(PostOp post, const memory::desc &dst) {
  dnnl::post_ops post_ops;
  if (post == PostOp::kAddRelu) post_ops.append_binary(dnnl::algorithm::binary_add, dst);
  if (post == PostOp::kAccumulateRelu) post_ops.append_sum(1.f);
  if (post != PostOp::kNone) post_ops.append_eltwise(dnnl::algorithm::eltwise_relu, 0.f, 0.f);
  dnnl::primitive_attr attr;
  attr.set_post_ops(post_ops);
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  return attr;
}

struct InferenceShape {
  memory::dims src, weights, dst, strides, padding;  // logical NCHW / OIHW dims
  PostOp post;
  Layout src_layout, dst_layout;  // the residual has dst's
};

// One layer's weights in the kernel's layout, as packed from `source` at `version`.
struct PackedWeights {
  int64_t version = -1;
  const void *source = nullptr;
  std::unique_ptr<Buffer> buffer = std::make_unique<Buffer>();
  std::unique_ptr<Buffer> bias = std::make_unique<Buffer>();  // a PixelPairs product's bias, one per output number
};

// What identifies a layer's weights: Python numbers every layer (unique in the process) and every update
// of its weights, and passes both as an int64 tensor, so packed weights are never reused for other values.
struct WeightsKey {
  int64_t layer, version;
};

// Packed weights kept at most: past this the caches are emptied and refilled (fused networks that are
// gone leave theirs behind). ResNet-152's weights are 240 MB.
constexpr size_t kPackedWeightsLimit = size_t(1) << 30;

struct InferencePlan {
  dnnl::primitive primitive;
  memory::desc src_desc, weights_desc, bias_desc, dst_desc, scratchpad_desc;
  std::map<int64_t, PackedWeights> packed;  // by layer
  // Where the kernel's weights come from: plain OIHW, or (a matrix product) the one tap of it that a one-pixel
  // map meets, as an (in, out) matrix view `weights_offset` floats into the OIHW weights, or the window of taps that
  // one output pixel meets, as (in x taps, out).
  memory::desc source_weights_desc;
  int64_t weights_offset = 0;
  // A matrix product for one output pixel of a larger map: the input pixels it meets, gathered from the input
  // (gather_from, a view of it) into (batch, in x taps) columns (gather_to); where the taps are not the whole
  // kernel, its window (window_from) is first copied into a contiguous (out, in x taps) matrix (window_to), which
  // source_weights_desc then reads. Empty descs where not.
  memory::desc gather_from, gather_to, window_from, window_to;
  // A matrix product of each sample's whole input with the PixelPairs matrix (source_weights_desc reads it,
  // expanded from the OIHW weights), and the bias repeated for each output pixel. Empty where not.
  std::optional<PixelPairs> pairs;
  // A matrix product run by PanelMatmul (no primitive) on weights packed as panels (weights_desc).
  bool panels = false;
  // A 3x3 convolution run by WinogradConvolution (no primitive) on WinogradWeights (weights_desc: their size): its
  // output tiles' size (2 or 4), or 0 where not.
  int64_t winograd = 0;
  // A layer on channel blocks run on NHWC copies (NhwcDetourPlan): the primitive reads src_desc and writes dst_desc
  // (NHWC); the layer's own input and output are reordered from and to these blocked descs. Empty where not.
  memory::desc blocked_src, blocked_dst;
  // Made once with the plan (InferenceRuntime::Bind), each call only pointing them at its tensors: making oneDNN's
  // memory objects and reorders at every call spent the main thread's time in malloc while the pool waited.
  // Whether the kernel's weights are a packed copy (else it reads them in place, weights_offset floats in).
  bool packs_weights = false;
  // The primitive's arguments (with the residual under kAddRelu), and the memory objects that map holds.
  memory src, weights, bias, dst, scratchpad, residual;
  std::unordered_map<int, memory> arguments;
  // The gather's and the NHWC detour's reorders, with the memory objects they run on.
  dnnl::reorder gather, to_nhwc, from_nhwc;
  memory gather_in, gather_out, nhwc_in, nhwc_out, blocked_in, blocked_out;
};

// One layer of a residual block run in a stage's call (InferenceRuntime::Stage).
struct BlockLayer {
  void *weights;
  memory::dims weights_dims;  // OIHW
  WeightsKey key;
  void *bias;
  int64_t stride, padding;
};

// A residual block: its main branch's layers in order, then its downsample layer where it has one.
struct StageBlock {
  std::vector<BlockLayer> layers;
  bool downsample;
};

// A layer's output dims (N, C, H, W) from its input's.
memory::dims ConvolutionOutput(const memory::dims &src, const BlockLayer &layer) {
  const memory::dims &w = layer.weights_dims;
  return {src[0], w[0], (src[2] + 2 * layer.padding - w[2]) / layer.stride + 1,
          (src[3] + 2 * layer.padding - w[3]) / layer.stride + 1};
}

size_t Bytes(const memory::dims &dims) {
  return static_cast<size_t>(dims[0] * dims[1] * dims[2] * dims[3]) * sizeof(float);
}

InferenceShape LayerShape(Layout layout, const memory::dims &src, const memory::dims &dst, const BlockLayer &layer,
                          PostOp post) {
  return {src, layer.weights_dims, dst, {layer.stride, layer.stride}, {layer.padding, layer.padding}, post, layout,
          layout};
}

class InferenceRuntime {
 public:
  static InferenceRuntime &Get() {
    static InferenceRuntime runtime;
    return runtime;
  }

  // src, residual and dst in the shape's layouts; weights plain OIHW, reordered into the kernel's layout when
  // the layer's weights changed (key) since they were last packed for this shape.
  void Convolution(const InferenceShape &shape, void *src, void *weights, WeightsKey key, void *bias,
                   void *residual, void *dst) {
    auto lock = executor_.Begin();
    InferencePlan &plan = GetPlan(shape);
    const bool windowed = !plan.window_from.is_zero(), paired = plan.pairs.has_value();
    void *kernel_weights = static_cast<float *>(weights) + plan.weights_offset;
    if (plan.packs_weights) {
      if (plan.packed.count(key.layer) == 0 && packed_bytes_ + plan.weights_desc.get_size() > kPackedWeightsLimit) {
        for (auto &entry : plans_) entry.second.packed.clear();
        packed_bytes_ = 0;
      }
      auto inserted = plan.packed.try_emplace(key.layer);
      if (inserted.second) packed_bytes_ += plan.weights_desc.get_size();
      PackedWeights &packed = inserted.first->second;
      kernel_weights = packed.buffer->Get(plan.weights_desc.get_size());
      if (packed.version != key.version || packed.source != weights) {
        memory plain_weights(plan.source_weights_desc, engine_, static_cast<float *>(weights) + plan.weights_offset);
        if (windowed) {
          memory window(plan.window_from, engine_, weights), matrix(plan.window_to, engine_, window_.Get(
                                                                       plan.window_to.get_size()));
          dnnl::reorder(window, matrix).execute(stream_, window, matrix);
          plain_weights = memory(plan.source_weights_desc, engine_, matrix.get_data_handle());
        }
        if (paired) {
          const PixelPairs &pairs = *plan.pairs;
          float *matrix = static_cast<float *>(window_.Get(plan.source_weights_desc.get_size()));
          ExpandPixelPairs(pairs, static_cast<const float *>(weights), matrix, executor_.pool);
          plain_weights = memory(plan.source_weights_desc, engine_, matrix);
          float *repeated = static_cast<float *>(packed.bias->Get(plan.bias_desc.get_size()));
          const float *per_channel = static_cast<const float *>(bias);
          for (int64_t row = 0; row < pairs.rows(); ++row) repeated[row] = per_channel[pairs.channel(row)];
        }
        if (plan.winograd) {
          const memory::dims &w = shape.weights;
          WinogradWeights(executor_.pool, static_cast<const float *>(weights), w[0], w[1], false, plan.winograd,
                          static_cast<float *>(kernel_weights));
        } else {
          memory packed_weights(plan.weights_desc, engine_, kernel_weights);
          dnnl::reorder(plain_weights, packed_weights).execute(stream_, plain_weights, packed_weights);
        }
        packed.version = key.version;
        packed.source = weights;
      }
      if (paired) bias = packed.bias->Get(plan.bias_desc.get_size());
    }
    void *blocked_dst = nullptr;
    if (!plan.blocked_src.is_zero()) {
      void *nhwc = detour_[0].Get(plan.src_desc.get_size());
      plan.blocked_in.set_data_handle(src);
      plan.nhwc_in.set_data_handle(nhwc);
      plan.to_nhwc.execute(stream_, plan.blocked_in, plan.nhwc_in);
      src = nhwc;
      blocked_dst = dst;
      dst = detour_[1].Get(plan.dst_desc.get_size());
    }
    if (!plan.gather_from.is_zero()) {
      void *columns = columns_.Get(plan.gather_to.get_size());
      plan.gather_in.set_data_handle(src);
      plan.gather_out.set_data_handle(columns);
      plan.gather.execute(stream_, plan.gather_in, plan.gather_out);
      src = columns;
    }
    if (plan.winograd) {
      const memory::dims &dims = shape.src;
      WinogradConvolution(executor_.pool, {dims[0], dims[1], shape.weights[0], dims[2], dims[3], plan.winograd},
                          static_cast<const float *>(src), static_cast<const float *>(kernel_weights),
                          static_cast<const float *>(bias),
                          // each output pixel's residual is read just before the pixel is written
                          static_cast<const float *>(shape.post == PostOp::kAccumulateRelu ? dst : residual),
                          shape.post != PostOp::kNone, static_cast<float *>(dst), winograd_buffers_.get());
      return;
    }
    if (plan.panels) {
      const memory::dims &dims = plan.src_desc.get_dims();
      PanelMatmul(executor_.pool, dims[0], dims[1], plan.dst_desc.get_dims()[1], static_cast<const float *>(src),
                  static_cast<const float *>(kernel_weights), static_cast<const float *>(bias),
                  static_cast<const float *>(residual), shape.post, static_cast<float *>(dst), packed_rows_);
      return;
    }
    plan.src.set_data_handle(src);
    plan.weights.set_data_handle(kernel_weights);
    plan.bias.set_data_handle(bias);
    plan.dst.set_data_handle(dst);
    plan.scratchpad.set_data_handle(scratchpad_.Get(plan.scratchpad_desc.get_size()));
    if (shape.post == PostOp::kAddRelu) plan.residual.set_data_handle(residual);
    plan.primitive.execute(stream_, plan.arguments);
    if (blocked_dst != nullptr) {
      plan.nhwc_out.set_data_handle(dst);
      plan.blocked_out.set_data_handle(blocked_dst);
      plan.from_nhwc.execute(stream_, plan.nhwc_out, plan.blocked_out);
    }
    stream_.wait();
  }

  // A stage of residual blocks in one call, all in `layout`: each block's main branch (ReLU after each layer but
  // the last, whose post-op adds the shortcut and then applies ReLU) and, with a downsample layer, the shortcut's
  // convolution of the block's input. The blocks' outputs all go to `out`, where each block's last layer
  // accumulates onto the shortcut in place (kAccumulateRelu): a downsampling block's shortcut is written there
  // first, and the next block's input and residual are that output. Only a first block without a downsample layer
  // adds x, which MindSpore owns, as a separate residual. One call instead of one per layer or block saves
  // MindSpore's launch of each op and its bookkeeping.
  void Stage(Layout layout, const memory::dims &x_dims, void *x, const std::vector<StageBlock> &blocks, void *out) {
    std::lock_guard<std::mutex> lock(block_mutex_);  // the intermediate buffers are shared by all stages
    memory::dims dims = x_dims;
    void *input = x;
    for (const StageBlock &block : blocks) {
      const std::vector<BlockLayer> &layers = block.layers;
      const int main = static_cast<int>(layers.size()) - (block.downsample ? 1 : 0);
      void *residual = input;  // a separate residual: x, or the shortcut where out holds the block's input
      if (block.downsample) {
        const BlockLayer &layer = layers.back();
        const memory::dims shortcut_dims = ConvolutionOutput(dims, layer);
        residual = input == out ? block_buffers_[2].Get(Bytes(shortcut_dims)) : out;
        Convolution(LayerShape(layout, dims, shortcut_dims, layer, PostOp::kNone), input, layer.weights, layer.key,
                    layer.bias, nullptr, residual);
      }
      const bool accumulate = residual == out;
      void *layer_input = input;
      for (int i = 0; i < main; ++i) {
        const BlockLayer &layer = layers[i];
        const bool last = i == main - 1;
        const memory::dims next = ConvolutionOutput(dims, layer);
        void *output = last ? out : block_buffers_[i % 2].Get(Bytes(next));
        const PostOp post = !last ? PostOp::kRelu : accumulate ? PostOp::kAccumulateRelu : PostOp::kAddRelu;
        Convolution(LayerShape(layout, dims, next, layer, post), layer_input, layer.weights, layer.key, layer.bias,
                    last && !accumulate ? residual : nullptr, output);
        layer_input = output;
        dims = next;
      }
      input = out;
    }
  }

  // Max pooling, src and dst in one layout; padded positions never win (as in torch's MaxPool2d).
  void MaxPool(const memory::dims &src_dims, const memory::dims &dst_dims, Layout layout, int kernel, int stride,
               int padding, void *src, void *dst) {
    auto lock = executor_.Begin();
    memory::desc src_desc(src_dims, memory::data_type::f32, LayoutTag(layout));
    memory::desc dst_desc(dst_dims, memory::data_type::f32, LayoutTag(layout));
    auto key = std::make_tuple(src_dims, dst_dims, static_cast<int>(layout), kernel, stride, padding);
    auto found = pools_.find(key);
    if (found == pools_.end()) {
      const memory::dims padding_r = PoolingPaddingR(src_dims, dst_dims, kernel, stride, padding);
      dnnl::primitive_attr attr;
      attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
      auto pd = dnnl::pooling_forward::primitive_desc(
          engine_, dnnl::prop_kind::forward_inference, dnnl::algorithm::pooling_max, src_desc, dst_desc,
          {stride, stride}, {kernel, kernel}, {0, 0}, {padding, padding}, padding_r, attr);
      found = pools_.emplace(key, std::make_pair(dnnl::pooling_forward(pd), pd.scratchpad_desc())).first;
    }
    memory scratchpad(found->second.second, engine_, scratchpad_.Get(found->second.second.get_size()));
    found->second.first.execute(stream_, {{DNNL_ARG_SRC, memory(src_desc, engine_, src)},
                                          {DNNL_ARG_DST, memory(dst_desc, engine_, dst)},
                                          {DNNL_ARG_SCRATCHPAD, scratchpad}});
    stream_.wait();
  }

 private:
  InferenceRuntime()
      : executor_(Executor::Get()), engine_(executor_.engine), stream_(executor_.stream) {}

  InferencePlan &GetPlan(const InferenceShape &shape) {
    auto key = std::make_tuple(shape.src, shape.weights, shape.dst, shape.strides, shape.padding,
                               static_cast<int>(shape.post), static_cast<int>(shape.src_layout),
                               static_cast<int>(shape.dst_layout));
    auto found = plans_.find(key);
    if (found != plans_.end()) return found->second;
    InferencePlan plan = MakePlan(shape);
    Bind(plan, shape.post);
    return plans_.emplace(key, std::move(plan)).first->second;
  }

  InferencePlan MakePlan(const InferenceShape &shape) {
    if (auto plan = MatrixProductPlan(shape)) return std::move(*plan);
    if (auto plan = PixelPairsPlan(shape)) return std::move(*plan);
    if (auto plan = WinogradPlan(shape)) return std::move(*plan);
    if (auto plan = NhwcDetourPlan(shape)) return std::move(*plan);
    memory::desc src(shape.src, memory::data_type::f32, LayoutTag(shape.src_layout));
    memory::desc weights(shape.weights, memory::data_type::f32, tag::any);
    memory::desc bias({shape.weights[0]}, memory::data_type::f32, tag::a);
    memory::desc dst(shape.dst, memory::data_type::f32, LayoutTag(shape.dst_layout));
    auto pd = dnnl::convolution_forward::primitive_desc(engine_, dnnl::prop_kind::forward_inference,
                                                        dnnl::algorithm::convolution_direct, src, weights, bias, dst,
                                                        shape.strides, shape.padding, shape.padding,
                                                        InferenceAttr(shape.post, dst));
    return InferencePlan{dnnl::convolution_forward(pd), src, pd.weights_desc(), bias, dst, pd.scratchpad_desc(), {},
                         memory::desc(shape.weights, memory::data_type::f32, tag::oihw), 0};
  }

  // The plan's memory objects, reorders and argument map, made once (Convolution points them at each call's
  // tensors).
  void Bind(InferencePlan &plan, PostOp post) {
    plan.packs_weights = plan.weights_desc != plan.source_weights_desc || !plan.window_from.is_zero() ||
                         plan.pairs.has_value();
    auto unbound = [&](const memory::desc &desc) { return memory(desc, engine_, nullptr); };
    if (!plan.gather_from.is_zero()) {
      plan.gather_in = unbound(plan.gather_from), plan.gather_out = unbound(plan.gather_to);
      plan.gather = dnnl::reorder(plan.gather_in, plan.gather_out);
    }
    if (!plan.blocked_src.is_zero()) {
      plan.blocked_in = unbound(plan.blocked_src), plan.nhwc_in = unbound(plan.src_desc);
      plan.nhwc_out = unbound(plan.dst_desc), plan.blocked_out = unbound(plan.blocked_dst);
      plan.to_nhwc = dnnl::reorder(plan.blocked_in, plan.nhwc_in);
      plan.from_nhwc = dnnl::reorder(plan.nhwc_out, plan.blocked_out);
    }
    if (!plan.primitive) return;  // Winograd and panels take pointers
    plan.src = unbound(plan.src_desc), plan.weights = unbound(plan.weights_desc);
    plan.bias = unbound(plan.bias_desc), plan.dst = unbound(plan.dst_desc);
    plan.scratchpad = unbound(plan.scratchpad_desc);
    plan.arguments = {{DNNL_ARG_SRC, plan.src}, {DNNL_ARG_WEIGHTS, plan.weights}, {DNNL_ARG_BIAS, plan.bias},
                      {DNNL_ARG_DST, plan.dst}, {DNNL_ARG_SCRATCHPAD, plan.scratchpad}};
    if (post == PostOp::kAddRelu) {
      plan.residual = unbound(plan.dst_desc);
      plan.arguments.emplace(DNNL_ARG_ATTR_MULTIPLE_POST_OP(0) | DNNL_ARG_SRC_1, plan.residual);
    }
  }

  // A layer whose output map is one pixel (layer4 at 32x32 with the ImageNet stem) is a matrix product:
  // (batch, in x taps) x (in x taps, out) with the window of kernel taps that pixel meets, bias and post-ops as the
  // convolution's. Every layout of a one-pixel map is that (batch, channels) matrix. Where the input is one pixel
  // too, the window is one tap and the input is the matrix; from a larger input (the stride-2 layers into layer4)
  // the pixels met are gathered first. oneDNN's convolution kernels run such shapes at about half a matrix
  // product's rate. None where the shape is otherwise, or where oneDNN has only its reference matmul for it.
  std::optional<InferencePlan> MatrixProductPlan(const InferenceShape &shape) {
    const auto f32 = memory::data_type::f32;
    const memory::desc x(shape.src, f32, LayoutTag(shape.src_layout));
    const auto window = OutputPixelWindow(x, shape.weights, shape.dst, shape.padding);
    if (!window) return std::nullopt;
    const memory::dims &w = shape.weights;
    const bool one_pixel = shape.src[2] == 1 && shape.src[3] == 1;
    const memory::dim batch = shape.src[0], in = w[1], out = w[0], k = in * window->rows * window->cols;
    memory::desc src({batch, k}, f32, tag::ab);
    memory::desc bias({1, out}, f32, tag::ab);
    memory::desc dst({batch, out}, f32, tag::ab);
    // The weights as the kernel reads them: the one tap a one-pixel input meets, at (padding, padding), or the
    // window's (in x taps, out) matrix.
    const memory::desc source = one_pixel ? TapAsInOut(in, out, w[2] * w[3])
                                          : memory::desc({k, out}, f32, memory::dims{1, k});
    const int64_t pad = shape.padding[0];
    auto matrix = MatrixPlan(shape.post, src, source, bias, dst);
    if (!matrix) return std::nullopt;
    InferencePlan &plan = *matrix;
    plan.weights_offset = one_pixel ? pad * w[3] + pad : 0;
    if (one_pixel) return matrix;
    plan.gather_from = window->x_view, plan.gather_to = window->x_dense;
    if (window->w_view != window->w_dense) plan.window_from = window->w_view, plan.window_to = window->w_dense;
    return matrix;
  }

  // Convolutions where every output pixel meets every input pixel (PixelPairs): (batch, C x H x W) times the
  // pairs' matrix, bias and post-ops as the convolution's; nullopt where the shape is otherwise or oneDNN has only
  // its reference matmul for it.
  std::optional<InferencePlan> PixelPairsPlan(const InferenceShape &shape) {
    auto run = [](Layout layout, int64_t channels) {
      return layout == Layout::kBlocked ? ChannelBlock() : layout == Layout::kNhwc ? channels : 1;
    };
    const auto pairs = AllPixelPairs(shape.src, shape.weights, shape.dst, shape.strides, shape.padding,
                                     run(shape.src_layout, shape.weights[1]), run(shape.dst_layout, shape.weights[0]));
    if (!pairs) return std::nullopt;
    const auto f32 = memory::data_type::f32;
    const int64_t batch = shape.src[0], k = pairs->columns(), rows = pairs->rows();
    memory::desc src({batch, k}, f32, tag::ab), bias({1, rows}, f32, tag::ab), dst({batch, rows}, f32, tag::ab);
    auto plan = MatrixPlan(shape.post, src, memory::desc({k, rows}, f32, memory::dims{1, k}), bias, dst);
    if (plan) plan->pairs = pairs;
    return plan;
  }

  // A 3x3 stride-1 convolution with padding 1 between 8-channel blocks, its output channels whole panels, on
  // AVX2 (PanelsUsable) and a map with enough tiles: WinogradConvolution. nullopt where not.
  std::optional<InferencePlan> WinogradPlan(const InferenceShape &shape) {
    const memory::dims &w = shape.weights, &src = shape.src;
    const bool geometry = w[2] == 3 && w[3] == 3 && shape.strides == memory::dims{1, 1} &&
                          shape.padding == memory::dims{1, 1} &&
                          shape.dst == memory::dims{src[0], w[0], src[2], src[3]};
    const bool layouts = shape.src_layout == Layout::kBlocked && shape.dst_layout == Layout::kBlocked;
    if (!geometry || !layouts) return std::nullopt;
    WinogradShape winograd{src[0], w[1], w[0], src[2], src[3], 4};  // F(4x4, 3x3) where it has the tiles
    if (!WinogradUsable(winograd)) winograd.tile = 2;
    if (!WinogradUsable(winograd)) return std::nullopt;
    const auto f32 = memory::data_type::f32;
    InferencePlan plan{{}, memory::desc(src, f32, LayoutTag(shape.src_layout)),
                       memory::desc({winograd.positions() * w[0] * w[1]}, f32, tag::a),
                       memory::desc({w[0]}, f32, tag::a), memory::desc(shape.dst, f32, LayoutTag(shape.dst_layout)),
                       {}, {}, memory::desc(w, f32, tag::oihw), 0};
    plan.winograd = winograd.tile;
    return plan;
  }

  // A 3x3 stride-2 layer between 8-channel blocks whose output is at most 14 pixels wide (ResNet's downsampling
  // 3x3 layers at 224x224 but the first, and all of them at 32x32): oneDNN's brgemm kernel on NHWC, the input and
  // output reordered around it. On these blocks oneDNN has only its direct jit:avx2 kernel for them, which ran them
  // at 78-116 GFLOP/s; the brgemm kernel with both reorders was 1.24-1.52x faster on ResNet-50's shapes (2 threads,
  // an ad-hoc timing), and level on the 56x56 input, where the reorders weigh more. Only ReLU or no post-op (the
  // residual would need a reorder too); nullopt where not, or where oneDNN's choice is not a brgemm kernel.
  std::optional<InferencePlan> NhwcDetourPlan(const InferenceShape &shape) {
    const memory::dims &w = shape.weights;
    const bool geometry = w[2] == 3 && w[3] == 3 && shape.strides == memory::dims{2, 2} && shape.dst[3] <= 14;
    const bool layouts = ChannelBlock() == 8 && shape.src_layout == Layout::kBlocked &&
                         shape.dst_layout == Layout::kBlocked &&
                         (shape.post == PostOp::kNone || shape.post == PostOp::kRelu);
    if (!geometry || !layouts) return std::nullopt;
    const auto f32 = memory::data_type::f32;
    memory::desc src(shape.src, f32, tag::nhwc), dst(shape.dst, f32, tag::nhwc);
    memory::desc weights(w, f32, tag::any), bias({w[0]}, f32, tag::a);
    auto pd = dnnl::convolution_forward::primitive_desc(engine_, dnnl::prop_kind::forward_inference,
                                                        dnnl::algorithm::convolution_direct, src, weights, bias, dst,
                                                        shape.strides, shape.padding, shape.padding,
                                                        InferenceAttr(shape.post, dst));
    if (!Brgemm(pd)) return std::nullopt;
    InferencePlan plan{dnnl::convolution_forward(pd), src, pd.weights_desc(), bias, dst, pd.scratchpad_desc(), {},
                       memory::desc(w, f32, tag::oihw), 0};
    plan.blocked_src = memory::desc(shape.src, f32, LayoutTag(shape.src_layout));
    plan.blocked_dst = memory::desc(shape.dst, f32, LayoutTag(shape.dst_layout));
    return plan;
  }

  // src (batch, k) times weights read through `source` (a (k, n) view of them), with bias (1, n) and the post-op,
  // into dst (batch, n): PanelMatmul where PanelKernelsUsable, else oneDNN's matmul (nullopt where that is its
  // reference one).
  std::optional<InferencePlan> MatrixPlan(PostOp post, const memory::desc &src, const memory::desc &source,
                                          const memory::desc &bias, const memory::desc &dst) {
    const memory::dim k = src.get_dims()[1], n = dst.get_dims()[1];
    if (PanelKernelsUsable(n)) {
      InferencePlan plan{{}, src, PanelsDesc(k, n), bias, dst, {}, {}, PanelsView(source), 0};
      plan.panels = true;
      return plan;
    }
    const auto pd = InferenceMatmul(engine_, src, {k, n}, bias, dst, InferenceAttr(post, dst));
    if (!pd) return std::nullopt;
    return InferencePlan{dnnl::matmul(*pd), src, pd->weights_desc(), bias, dst, pd->scratchpad_desc(), {}, source, 0};
  }

  Executor &executor_;
  dnnl::engine &engine_;
  dnnl::stream &stream_;
  Buffer scratchpad_;
  Buffer columns_, window_;  // gathered input pixels; a window of taps on its way to being packed
  Buffer packed_rows_;       // a matrix product's input in PackRowBlocks' layout
  Buffer detour_[2];         // an NhwcDetourPlan layer's input and output in NHWC
  std::unique_ptr<Buffer[]> winograd_buffers_{new Buffer[2 * static_cast<size_t>(executor_.pool.get_num_threads())]};
  std::mutex block_mutex_;
  Buffer block_buffers_[3];  // a block's intermediate outputs, alternately, and a shortcut that can't go to out
  size_t packed_bytes_ = 0;
  std::map<std::tuple<memory::dims, memory::dims, memory::dims, memory::dims, memory::dims, int, int, int>,
           InferencePlan>
      plans_;
  std::map<std::tuple<memory::dims, memory::dims, int, int, int, int>, std::pair<dnnl::pooling_forward, memory::desc>>
      pools_;
};

memory::dims Dims(int64_t *shape) { return memory::dims(shape, shape + 4); }

bool CheckTensors(const char *what, int nparam, int expected, int *ndims, const char **dtypes, const int *wanted_ndims,
                  const char *const *wanted_dtypes) {
  if (nparam != expected) {
    std::fprintf(stderr, "%s: expected %d tensors (inputs and output), got %d\n", what, expected, nparam);
    return false;
  }
  for (int i = 0; i < nparam; ++i) {
    if (ndims[i] != wanted_ndims[i] || std::strcmp(dtypes[i], wanted_dtypes[i]) != 0) {
      std::fprintf(stderr, "%s: tensor %d must be %d-d %s, got %d-d %s\n", what, i, wanted_ndims[i], wanted_dtypes[i],
                   ndims[i], dtypes[i]);
      return false;
    }
  }
  return true;
}

template <typename Call>
int Guarded(const char *what, Call call) {
  try {
    call();
  } catch (const dnnl::error &error) {
    std::fprintf(stderr, "%s: oneDNN error %d: %s\n", what, static_cast<int>(error.status), error.what());
    return 1;
  } catch (const std::exception &error) {
    std::fprintf(stderr, "%s: %s\n", what, error.what());
    return 1;
  }
  return 0;
}

// params: inputs then output, all plain NCHW/OIHW float32.
int Launch(Direction direction, int stride, int padding, int nparam, void **params, int *ndims, int64_t **shapes,
           const char **dtypes) {
  const int wanted_ndims[] = {4, 4, 4, 4};
  const char *const wanted_dtypes[] = {"float32", "float32", "float32", "float32"};
  if (!CheckTensors("onednn_conv", nparam, direction == Direction::kForward ? 3 : 4, ndims, dtypes, wanted_ndims,
                    wanted_dtypes)) {
    return 1;
  }
  // Inputs: forward (x, w), backward data (dy, w, x: shape only), backward weights (dy, x, w: shape only);
  // the last param is the output.
  Shape shape;
  shape.strides = {stride, stride};
  shape.padding = {padding, padding};
  void *first = params[0], *second = params[1];
  if (direction == Direction::kForward) {
    shape.src = Dims(shapes[0]), shape.weights = Dims(shapes[1]), shape.dst = Dims(shapes[2]);
  } else if (direction == Direction::kBackwardData) {
    shape.dst = Dims(shapes[0]), shape.weights = Dims(shapes[1]), shape.src = Dims(shapes[3]);
  } else {
    shape.dst = Dims(shapes[0]), shape.src = Dims(shapes[1]), shape.weights = Dims(shapes[3]);
  }
  return Guarded("onednn_conv", [&] { Runtime::Get().Run(direction, shape, first, second, params[nparam - 1]); });
}

// (x blocked, y blocked, the weight gradient's layouts allowed, ReLU) from the training ops' layouts tensor of
// `count` numbers (int64: x's and y's layout, 0 plain NCHW, 1 channel blocks; the weight gradient's, a
// WeightGradient, see GradientLayouts; 1 for the ReLU, else 0), checked against the tensors' channels; false (with
// a message) when it can't be used.
bool ReadTrainingLayouts(const char *what, const int64_t *layouts, int64_t count, const Shape &shape, bool *x_blocked,
                         bool *y_blocked, WeightGradient *weight_gradient, bool *relu) {
  if (count != 4) {
    std::fprintf(stderr, "%s: the layouts (x's, y's, the weight gradient's, ReLU) must be 4 numbers, got %lld\n",
                 what, static_cast<long long>(count));
    return false;
  }
  for (int i = 0; i < 4; ++i) {
    const int64_t most = i == 2 ? static_cast<int64_t>(WeightGradient::kBlocksOrWindow) : 1;
    if (layouts[i] < 0 || layouts[i] > most) {
      std::fprintf(stderr, "%s: layout entry %d is %lld, not 0 to %lld\n", what, i, static_cast<long long>(layouts[i]),
                   static_cast<long long>(most));
      return false;
    }
  }
  *x_blocked = layouts[0] == 1, *y_blocked = layouts[1] == 1;
  *weight_gradient = static_cast<WeightGradient>(layouts[2]);
  *relu = layouts[3] == 1;
  if (*x_blocked && shape.src[1] % ChannelBlock() != 0) {
    std::fprintf(stderr, "%s: a blocked input needs channels in multiples of %d, got %lld\n", what, ChannelBlock(),
                 static_cast<long long>(shape.src[1]));
    return false;
  }
  return true;
}

// The bytes of the ReLU mask that a conv+BatchNorm call keeps for its gradient (oneDNN's workspace of
// fuse_norm_relu) for output dims; a call without ReLU leaves it unused. Kept per dims: every conv+BatchNorm call
// checks its mask's size, and creating the BatchNorm's description each time took about 6 microseconds, some 0.5 %
// of a training step at 32x32.
int64_t ReluMaskBytes(const memory::dims &dst) {
  static std::mutex mutex;
  static std::map<memory::dims, int64_t> known;
  std::lock_guard<std::mutex> lock(mutex);
  const auto found = known.find(dst);
  if (found != known.end()) return found->second;
  const memory::desc blocked(dst, memory::data_type::f32, BlockedTag());
  const auto flags = dnnl::normalization_flags::use_scale | dnnl::normalization_flags::use_shift |
                     dnnl::normalization_flags::fuse_norm_relu;
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);  // not the executor's: that would fix the pool's size
  auto forward = dnnl::batch_normalization_forward::primitive_desc(engine, dnnl::prop_kind::forward_training,
                                                                    blocked, blocked, 1e-5f, flags);
  return known[dst] = static_cast<int64_t>(forward.workspace_desc().get_size());
}

bool CheckReluMask(const char *what, const memory::dims &dst, int64_t bytes) {
  const int64_t wanted = ReluMaskBytes(dst);
  if (bytes == wanted) return true;
  std::fprintf(stderr, "%s: the ReLU mask must be %lld bytes, got %lld\n", what, static_cast<long long>(wanted),
               static_cast<long long>(bytes));
  return false;
}

// params: x, weights, gamma, beta, moving mean, moving variance, (eps, momentum), layouts (int64: x's, y's, the
// weight gradient's, ReLU; see ReadTrainingLayouts), with residual_add_relu the residual (y's shape, channel blocks),
// then the outputs y, conv_out, batch mean, batch variance (biased), new moving mean, new moving variance, and
// (uint8, 1-d) the ReLU's mask for the gradient (onednn_conv_relu_mask_bytes long, unused without ReLU); all float32
// but layouts. The moving statistics are updated as nn.BatchNorm2d updates them (momentum: the batch's weight; the
// unbiased batch variance), here rather than in the graph, where they took seven small ops per BatchNorm.
// residual_add_relu: y = max(0, BatchNorm(conv(x)) + residual), a residual block's end, with y in channel blocks
// and no ReLU in the layouts (the BatchNorm's own); its gradient is ConvBnBackward's of ReLU's gradient.
int LaunchConvBnForward(int stride, int padding, bool residual_add_relu, int nparam, void **params, int *ndims,
                        int64_t **shapes, const char **dtypes) {
  const char *what = residual_add_relu ? "onednn_conv conv+batchnorm+add+relu" : "onednn_conv conv+batchnorm";
  std::vector<int> wanted_ndims = {4, 4, 1, 1, 1, 1, 1, 1, 4, 4, 1, 1, 1, 1, 1};
  std::vector<const char *> wanted_dtypes = {"float32", "float32", "float32", "float32", "float32",
                                             "float32", "float32", "int64",   "float32", "float32",
                                             "float32", "float32", "float32", "float32", "uint8"};
  const int inputs = residual_add_relu ? 9 : 8;
  if (residual_add_relu) {  // the residual, after the layouts
    wanted_ndims.insert(wanted_ndims.begin() + 8, 4);
    wanted_dtypes.insert(wanted_dtypes.begin() + 8, "float32");
  }
  if (!CheckTensors(what, nparam, inputs + 7, ndims, dtypes, wanted_ndims.data(), wanted_dtypes.data())) return 1;
  void **outputs = params + inputs;
  int64_t **output_shapes = shapes + inputs;
  Shape shape{Dims(shapes[0]), Dims(shapes[1]), Dims(output_shapes[0]), {stride, stride}, {padding, padding}};
  if (shape.dst[1] % ChannelBlock() != 0 || shapes[6][0] != 2 || shapes[7][0] != 4) {
    std::fprintf(stderr,
                 "%s: needs output channels in multiples of %d, (eps, momentum) and four layout numbers, got %lld, "
                 "%lld and %lld\n",
                 what, ChannelBlock(), static_cast<long long>(shape.dst[1]), static_cast<long long>(shapes[6][0]),
                 static_cast<long long>(shapes[7][0]));
    return 1;
  }
  bool x_blocked, y_blocked, relu;
  WeightGradient weight_gradient;
  if (!ReadTrainingLayouts(what, static_cast<const int64_t *>(params[7]), shapes[7][0], shape, &x_blocked,
                           &y_blocked, &weight_gradient, &relu) ||
      !CheckReluMask(what, shape.dst, output_shapes[6][0])) {
    return 1;
  }
  if (residual_add_relu && (!y_blocked || relu || Dims(shapes[8]) != shape.dst)) {
    std::fprintf(stderr, "%s: needs y in channel blocks, no ReLU in the layouts and a residual of y's shape\n", what);
    return 1;
  }
  const float *constants = static_cast<const float *>(params[6]);
  const float eps = constants[0], momentum = constants[1];
  return Guarded(what, [&] {
    Runtime::Get().ConvBnForward(shape, eps, x_blocked, y_blocked, relu, params[0], params[1], params[2],
                                 params[3], outputs[0], outputs[1], outputs[2], outputs[3], outputs[6],
                                 residual_add_relu ? params[8] : nullptr);
    const int64_t count = shape.dst[0] * shape.dst[2] * shape.dst[3];
    const float unbiased = static_cast<float>(count) / static_cast<float>(std::max<int64_t>(count - 1, 1));
    const auto *moving_mean = static_cast<const float *>(params[4]);
    const auto *moving_variance = static_cast<const float *>(params[5]);
    const auto *mean = static_cast<const float *>(outputs[2]);
    const auto *variance = static_cast<const float *>(outputs[3]);
    auto *new_mean = static_cast<float *>(outputs[4]), *new_variance = static_cast<float *>(outputs[5]);
    for (int64_t c = 0; c < shape.dst[1]; ++c) {
      new_mean[c] = moving_mean[c] * (1 - momentum) + mean[c] * momentum;
      new_variance[c] = moving_variance[c] * (1 - momentum) + variance[c] * unbiased * momentum;
    }
  });
}

// params: dy, conv_out, mean, variance, gamma, (eps, momentum), layouts (as the forward's), x, weights, the
// forward's ReLU mask, then the outputs dx, dw, dgamma, dbeta and the convolution's output gradient (dy's shape,
// channel blocks: working memory that MindSpore allocates and reuses once the call is done, where a buffer of the
// library's would stay).
int LaunchConvBnBackward(bool defer_input, int stride, int padding, int nparam, void **params, int *ndims,
                         int64_t **shapes, const char **dtypes) {
  const char *what = "onednn_conv conv+batchnorm gradient";
  const int wanted_ndims[] = {4, 4, 1, 1, 1, 1, 1, 4, 4, 1, 4, 4, 1, 1, 4};
  const char *const wanted_dtypes[] = {"float32", "float32", "float32", "float32", "float32",
                                       "float32", "int64",   "float32", "float32", "uint8",
                                       "float32", "float32", "float32", "float32", "float32"};
  if (!CheckTensors(what, nparam, defer_input ? 14 : 15, ndims, dtypes, wanted_ndims, wanted_dtypes)) return 1;
  Shape shape{Dims(shapes[7]), Dims(shapes[8]), Dims(shapes[0]), {stride, stride}, {padding, padding}};
  bool x_blocked, y_blocked, relu;
  WeightGradient weight_gradient;
  if (!ReadTrainingLayouts(what, static_cast<const int64_t *>(params[6]), shapes[6][0], shape, &x_blocked,
                           &y_blocked, &weight_gradient, &relu) ||
      !CheckReluMask(what, shape.dst, shapes[9][0])) {
    return 1;
  }
  const float eps = *static_cast<const float *>(params[5]);
  return Guarded(what, [&] {
    Runtime::Get().ConvBnBackward(shape, eps, x_blocked, y_blocked, relu, weight_gradient, params[0],
                                  params[1], params[2], params[3], params[4], params[7], params[8], params[9],
                                  defer_input ? nullptr : params[10], params[11], params[12], params[13],
                                  defer_input ? params[10] : params[14]);
  });
}

// Deferred input gradient, training. LaunchConvBnBackward with defer_input: the same params but the outputs d_conv_out
// (y's shape, channel blocks), dw, dgamma, dbeta. LaunchConvBnBackwardData: params d_conv_out, weights, layouts (as
// the forward's), x (for its shape), then the output dx.
int LaunchConvBnBackwardData(int stride, int padding, int nparam, void **params, int *ndims, int64_t **shapes,
                             const char **dtypes) {
  const char *what = "onednn_conv conv+batchnorm input gradient";
  const int wanted_ndims[] = {4, 4, 1, 4, 4};
  const char *const wanted_dtypes[] = {"float32", "float32", "int64", "float32", "float32"};
  if (!CheckTensors(what, nparam, 5, ndims, dtypes, wanted_ndims, wanted_dtypes)) return 1;
  Shape shape{Dims(shapes[3]), Dims(shapes[1]), Dims(shapes[0]), {stride, stride}, {padding, padding}};
  bool x_blocked, y_blocked, relu;
  WeightGradient weight_gradient;
  if (!ReadTrainingLayouts(what, static_cast<const int64_t *>(params[2]), shapes[2][0], shape, &x_blocked,
                           &y_blocked, &weight_gradient, &relu)) {
    return 1;
  }
  return Guarded(what, [&] { Runtime::Get().ConvBnBackwardData(shape, x_blocked, params[0], params[1], params[4]); });
}

// params: x, output (same shape, 4-d float32, channels in whole blocks).
int LaunchReorder(bool to_blocked, int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  const char *what = to_blocked ? "onednn_conv to channel blocks" : "onednn_conv from channel blocks";
  const int wanted_ndims[] = {4, 4};
  const char *const wanted_dtypes[] = {"float32", "float32"};
  if (!CheckTensors(what, nparam, 2, ndims, dtypes, wanted_ndims, wanted_dtypes)) return 1;
  if (shapes[0][1] % ChannelBlock() != 0) {
    std::fprintf(stderr, "%s: needs channels in multiples of %d, got %lld\n", what, ChannelBlock(),
                 static_cast<long long>(shapes[0][1]));
    return 1;
  }
  return Guarded(what, [&] { Runtime::Get().Reorder(Dims(shapes[0]), to_blocked, params[0], params[1]); });
}

// The training stem's ReLU and max pool on channel blocks (see Runtime::ReluMaxPoolForward). params: x, y,
// workspace (uint8, y's shape: each output's argmax).
int LaunchReluMaxPoolForward(int kernel, int stride, int padding, int nparam, void **params, int *ndims,
                             int64_t **shapes, const char **dtypes) {
  const char *what = "onednn_conv ReLU and max pool";
  const int wanted_ndims[] = {4, 4, 4};
  const char *const wanted_dtypes[] = {"float32", "float32", "uint8"};
  if (!CheckTensors(what, nparam, 3, ndims, dtypes, wanted_ndims, wanted_dtypes)) return 1;
  const size_t workspace_bytes = static_cast<size_t>(shapes[2][0] * shapes[2][1] * shapes[2][2] * shapes[2][3]);
  return Guarded(what, [&] {
    Runtime::Get().ReluMaxPoolForward(Dims(shapes[0]), Dims(shapes[1]), kernel, stride, padding, params[0],
                                      params[1], params[2], workspace_bytes);
  });
}

// Its gradient. params: dy, y, workspace, x (for its shape), dx, masked dy (working memory, y's shape).
int LaunchReluMaxPoolBackward(int kernel, int stride, int padding, int nparam, void **params, int *ndims,
                              int64_t **shapes, const char **dtypes) {
  const char *what = "onednn_conv ReLU and max pool gradient";
  const int wanted_ndims[] = {4, 4, 4, 4, 4, 4};
  const char *const wanted_dtypes[] = {"float32", "float32", "uint8", "float32", "float32", "float32"};
  if (!CheckTensors(what, nparam, 6, ndims, dtypes, wanted_ndims, wanted_dtypes)) return 1;
  return Guarded(what, [&] {
    Runtime::Get().ReluMaxPoolBackward(Dims(shapes[3]), Dims(shapes[0]), kernel, stride, padding, params[0],
                                       params[1], params[2], params[4], params[5]);
  });
}

// A layout number from Python, checked; false (with a message) when it is none or when the tensor's channels
// don't fill whole channel blocks.
bool ReadLayout(const char *what, int64_t number, int64_t *shape, Layout *layout) {
  if (number < 0 || number > static_cast<int64_t>(Layout::kBlocked)) {
    std::fprintf(stderr, "%s: unknown layout %lld\n", what, static_cast<long long>(number));
    return false;
  }
  *layout = static_cast<Layout>(number);
  if (*layout == Layout::kBlocked && shape[1] % ChannelBlock() != 0) {
    std::fprintf(stderr, "%s: the blocked layout needs channels in multiples of %d, got %lld\n", what,
                 ChannelBlock(), static_cast<long long>(shape[1]));
    return false;
  }
  return true;
}

// MindSpore's shape of a tensor in `layout` as oneDNN's logical dims (N, C, H, W).
memory::dims LogicalDims(Layout layout, int64_t *shape) {
  if (layout == Layout::kNhwc) return {shape[0], shape[3], shape[1], shape[2]};
  return Dims(shape);
}

// params: x, weights (OIHW), weights key (int64: layer, version), layouts (int64: x's, output's), bias,
// [residual (the output's layout),] output.
int LaunchInference(PostOp post, int stride, int padding, int nparam, void **params, int *ndims, int64_t **shapes,
                    const char **dtypes) {
  const char *what = "onednn_conv inference";
  const bool add = post == PostOp::kAddRelu;
  const int wanted_ndims[] = {4, 4, 1, 1, 1, 4, 4};
  const char *const wanted_dtypes[] = {"float32", "float32", "int64", "int64", "float32", "float32", "float32"};
  if (!CheckTensors(what, nparam, add ? 7 : 6, ndims, dtypes, wanted_ndims, wanted_dtypes)) return 1;
  if (shapes[2][0] != 2 || shapes[3][0] != 2) {
    std::fprintf(stderr, "%s: the weights key (layer, version) and the layouts (x, output) must hold 2 numbers each\n",
                 what);
    return 1;
  }
  const int64_t *key = static_cast<const int64_t *>(params[2]);
  const int64_t *layouts = static_cast<const int64_t *>(params[3]);
  Layout src_layout, dst_layout;
  if (!ReadLayout(what, layouts[0], shapes[0], &src_layout) ||
      !ReadLayout(what, layouts[1], shapes[nparam - 1], &dst_layout)) {
    return 1;
  }
  InferenceShape shape{LogicalDims(src_layout, shapes[0]), Dims(shapes[1]), LogicalDims(dst_layout, shapes[nparam - 1]),
                       {stride, stride}, {padding, padding}, post, src_layout, dst_layout};
  return Guarded(what, [&] {
    InferenceRuntime::Get().Convolution(shape, params[0], params[1], {key[0], key[1]}, params[4],
                                        add ? params[5] : nullptr, params[nparam - 1]);
  });
}

// params: x, layout (int64: the activations'), geometry (int64: the count of blocks, then for each block its count
// of layers, 1 with a downsample layer or else 0, and each layer's stride and padding), then each layer's weights
// (OIHW), weights key (int64: layer, version) and bias (block by block: the main branch in order, then the
// downsample), then the output.
int LaunchStageInference(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  const char *what = "onednn_conv stage inference";
  const int count = (nparam - 4) / 3;
  if (nparam < 10 || (nparam - 4) % 3 != 0) {
    std::fprintf(stderr, "%s: expected x, layout, geometry, 3 tensors per layer (2 layers or more) and the output, "
                 "got %d tensors\n", what, nparam);
    return 1;
  }
  std::vector<int> wanted_ndims = {4, 1, 1};
  std::vector<const char *> wanted_dtypes = {"float32", "int64", "int64"};
  for (int i = 0; i < count; ++i) {
    wanted_ndims.insert(wanted_ndims.end(), {4, 1, 1});
    wanted_dtypes.insert(wanted_dtypes.end(), {"float32", "int64", "float32"});
  }
  wanted_ndims.push_back(4);
  wanted_dtypes.push_back("float32");
  if (!CheckTensors(what, nparam, nparam, ndims, dtypes, wanted_ndims.data(), wanted_dtypes.data())) return 1;
  Layout layout;
  if (shapes[1][0] != 1) {
    std::fprintf(stderr, "%s: the layout must hold 1 number\n", what);
    return 1;
  }
  if (!ReadLayout(what, *static_cast<const int64_t *>(params[1]), shapes[0], &layout)) return 1;
  // The geometry must describe exactly `count` layers in blocks of 2 or more (3 or more with a downsample).
  const int64_t *geometry = static_cast<const int64_t *>(params[2]);
  const int64_t numbers = shapes[2][0];
  std::vector<StageBlock> blocks;
  int64_t at = 1, layer_count = 0;
  for (int64_t b = 0; numbers >= 1 && b < geometry[0]; ++b) {
    if (at + 2 > numbers) break;
    const int64_t layers = geometry[at], downsample = geometry[at + 1];
    if (layers < 2 + downsample || (downsample != 0 && downsample != 1) || at + 2 + 2 * layers > numbers ||
        layer_count + layers > count) {
      break;
    }
    StageBlock block{{}, downsample == 1};
    for (int64_t i = 0; i < layers; ++i, ++layer_count) {
      void **layer = params + 3 + 3 * layer_count;
      if (shapes[4 + 3 * layer_count][0] != 2) {
        std::fprintf(stderr, "%s: a weights key must hold 2 numbers (layer, version)\n", what);
        return 1;
      }
      const int64_t *key = static_cast<const int64_t *>(layer[1]);
      block.layers.push_back({layer[0], Dims(shapes[3 + 3 * layer_count]), {key[0], key[1]}, layer[2],
                              geometry[at + 2 + 2 * i], geometry[at + 3 + 2 * i]});
    }
    blocks.push_back(std::move(block));
    at += 2 + 2 * layers;
  }
  if (numbers < 1 || geometry[0] < 1 || static_cast<int64_t>(blocks.size()) != geometry[0] || at != numbers ||
      layer_count != count) {
    std::fprintf(stderr, "%s: the geometry (%lld numbers) does not describe the %d layers passed\n", what,
                 static_cast<long long>(numbers), count);
    return 1;
  }
  return Guarded(what, [&] {
    InferenceRuntime::Get().Stage(layout, LogicalDims(layout, shapes[0]), params[0], blocks, params[nparam - 1]);
  });
}

// params: x, layout (int64: x's and the output's), output.
int LaunchMaxPool(int kernel, int stride, int padding, int nparam, void **params, int *ndims, int64_t **shapes,
                  const char **dtypes) {
  const char *what = "onednn_conv max pool";
  const int wanted_ndims[] = {4, 1, 4};
  const char *const wanted_dtypes[] = {"float32", "int64", "float32"};
  if (!CheckTensors(what, nparam, 3, ndims, dtypes, wanted_ndims, wanted_dtypes)) return 1;
  Layout layout;
  if (shapes[1][0] != 1 || !ReadLayout(what, *static_cast<const int64_t *>(params[1]), shapes[0], &layout)) return 1;
  return Guarded(what, [&] {
    InferenceRuntime::Get().MaxPool(LogicalDims(layout, shapes[0]), LogicalDims(layout, shapes[2]), layout, kernel,
                                    stride, padding, params[0], params[2]);
  });
}

// The optimizers' steps over `count` elements. The square root and division make Adam compute-bound, so each
// step is compiled for AVX-512, AVX2 and the baseline, and run on the widest that oneDNN's ISA in effect allows
// (which honours ONEDNN_MAX_CPU_ISA, as benchmark.py --isa avx2 expects). IEEE sqrt and division, no contraction
// into FMAs: every variant computes what the scalar code does, and what MindSpore's own kernels compute.
#define ADAM_STEP_LOOP                                                        \
  for (int64_t i = 0; i < count; ++i) {                                       \
    const float grad = g[i] + w[i] * decay;                                   \
    const float m_new = m[i] + (grad - m[i]) * (1.0f - beta1);                \
    const float v_new = v[i] + (grad * grad - v[i]) * (1.0f - beta2);         \
    m[i] = m_new;                                                             \
    v[i] = v_new;                                                             \
    w[i] -= step * m_new / (__builtin_sqrtf(v_new) + eps);                    \
  }
// nn.Momentum (MindSpore's ApplyMomentum): accum = accum * momentum + gradient, weight -= lr * accum.
#define MOMENTUM_STEP_LOOP                                                    \
  for (int64_t i = 0; i < count; ++i) {                                       \
    const float grad = g[i] + w[i] * decay;                                   \
    const float a_new = a[i] * momentum + grad;                               \
    a[i] = a_new;                                                             \
    w[i] -= lr * a_new;                                                       \
  }
// nn.SGD with nesterov (MindSpore's SGD kernel, dampening 0): the first step (stat > 0) sets accum to the
// gradient and clears stat; the weight moves by lr * (gradient + momentum * accum).
#define NESTEROV_STEP_LOOP                                                    \
  for (int64_t i = 0; i < count; ++i) {                                       \
    const float grad = g[i] + w[i] * decay;                                   \
    const float a_new = s[i] > 0.0f ? grad : a[i] * momentum + grad;          \
    a[i] = a_new;                                                             \
    s[i] = 0.0f;                                                              \
    w[i] -= lr * (grad + a_new * momentum);                                   \
  }
#define ADAM_STEP_ARGS                                                                                     \
  float *__restrict w, float *__restrict m, float *__restrict v, const float *__restrict g, int64_t count, \
      float decay, float beta1, float beta2, float eps, float step
#define MOMENTUM_STEP_ARGS                                                                             \
  float *__restrict w, float *__restrict a, const float *__restrict g, int64_t count, float decay, float lr, \
      float momentum
#define NESTEROV_STEP_ARGS                                                                                 \
  float *__restrict w, float *__restrict a, float *__restrict s, const float *__restrict g, int64_t count, \
      float decay, float lr, float momentum
#define DEFINE_STEP_VARIANTS(NAME, ARGS, LOOP)                                                         \
  __attribute__((target("avx512f"), optimize("O3", "fp-contract=off"))) void NAME##Avx512(ARGS) { LOOP } \
  __attribute__((target("avx2"), optimize("O3", "fp-contract=off"))) void NAME##Avx2(ARGS) { LOOP }      \
  __attribute__((optimize("O3", "fp-contract=off"))) void NAME##Baseline(ARGS) { LOOP }

DEFINE_STEP_VARIANTS(AdamStep, ADAM_STEP_ARGS, ADAM_STEP_LOOP)
DEFINE_STEP_VARIANTS(MomentumStep, MOMENTUM_STEP_ARGS, MOMENTUM_STEP_LOOP)
DEFINE_STEP_VARIANTS(NesterovStep, NESTEROV_STEP_ARGS, NESTEROV_STEP_LOOP)

// The vector width (512, 256 or 128 bits) the steps run at: the widest oneDNN's ISA in effect and the CPU allow.
int StepVectorBits() {
  const int isa = static_cast<int>(dnnl::get_effective_cpu_isa());
  const int avx512 = static_cast<int>(dnnl::cpu_isa::avx512_core), avx2 = static_cast<int>(dnnl::cpu_isa::avx2);
  if ((isa & avx512) == avx512 && __builtin_cpu_supports("avx512f")) return 512;
  if ((isa & avx2) == avx2 && __builtin_cpu_supports("avx2")) return 256;
  return 128;
}

template <typename Step>
Step ChooseStep(Step avx512, Step avx2, Step baseline) {
  const int bits = StepVectorBits();
  return bits == 512 ? avx512 : bits == 256 ? avx2 : baseline;
}

// The residual addition and the ReLU after it (training, element-wise, so in any layout): y = max(0, a + b), NaN
// kept; and the gradient of both inputs from the output: 0 where y <= 0, else dy. Both as torch's ReLU (whose
// gradient passes on where the output is NaN).
#define ADD_RELU_ARGS const float *__restrict a, const float *__restrict b, float *__restrict y, int64_t count
#define ADD_RELU_LOOP                        \
  for (int64_t i = 0; i < count; ++i) {      \
    const float sum = a[i] + b[i];           \
    y[i] = sum < 0.0f ? 0.0f : sum;          \
  }
#define RELU_GRADIENT_ARGS \
  const float *__restrict dy, const float *__restrict y, float *__restrict dx, int64_t count
#define RELU_GRADIENT_LOOP \
  for (int64_t i = 0; i < count; ++i) dx[i] = y[i] <= 0.0f ? 0.0f : dy[i];
// The gradient of a ReLU's output that has two users (a residual block's input, which its first convolution and its
// identity read), from theirs: 0 where y <= 0, else da + db. One pass where the sum alone had been one. The sum's bits
// are masked, not chosen by a condition: written as y <= 0 ? 0 : da + db, the compiler moved the addition under the
// condition (an addition may trap, so it is not done where it is not asked for) and the loop ran one number at a time.
#define RELU_GRADIENT_OF_SUM_ARGS                                                                          \
  const float *__restrict da, const float *__restrict db, const float *__restrict y, float *__restrict dx, \
      int64_t count
#define RELU_GRADIENT_OF_SUM_LOOP                                                   \
  for (int64_t i = 0; i < count; ++i) {                                             \
    const float sum = da[i] + db[i];                                                \
    uint32_t bits;                                                                  \
    std::memcpy(&bits, &sum, sizeof bits);                                          \
    bits &= y[i] <= 0.0f ? 0u : ~0u;                                                \
    std::memcpy(dx + i, &bits, sizeof bits);                                        \
  }
DEFINE_STEP_VARIANTS(AddReluPass, ADD_RELU_ARGS, ADD_RELU_LOOP)
DEFINE_STEP_VARIANTS(ReluGradientPass, RELU_GRADIENT_ARGS, RELU_GRADIENT_LOOP)
DEFINE_STEP_VARIANTS(ReluGradientOfSumPass, RELU_GRADIENT_OF_SUM_ARGS, RELU_GRADIENT_OF_SUM_LOOP)

// A residual block's last BatchNorm with its addition and ReLU (ConvBnForward with a residual), on one plane of a
// channel block (one image's pixels, B channels a pixel): ChannelSums adds the sums of each value less its channel's
// shift, and of their squares, into `sum` and `squares` (B each): a row of pixels at a time in float, then in double,
// so that the sums keep their digits over large maps. NormalizeAddRelu writes y = max(0, (x - mean) * scale + beta +
// residual) over `pixels` pixels, NaN kept, as BatchNorm, AddRelu's addition and its ReLU compute it one after the
// other. A channel block is one vector with AVX-512 (16) and AVX2 (8); the baseline loops over the 8.
#define CHANNEL_SUMS_ARGS                                                                                       \
  const float *__restrict plane, int64_t rows, int64_t width, const float *__restrict shift, double *__restrict sum, \
      double *__restrict squares
#define NORMALIZE_ADD_RELU_ARGS                                                                               \
  const float *__restrict x, const float *__restrict residual, const float *__restrict mean,                 \
      const float *__restrict inverse, const float *__restrict gamma, const float *__restrict beta,             \
      float *__restrict y, int64_t pixels

__attribute__((target("avx512f"))) void ChannelSumsAvx512(CHANNEL_SUMS_ARGS) {
  const __m512 k = _mm512_loadu_ps(shift);
  __m512d sum_low = _mm512_loadu_pd(sum), sum_high = _mm512_loadu_pd(sum + 8);
  __m512d squares_low = _mm512_loadu_pd(squares), squares_high = _mm512_loadu_pd(squares + 8);
  for (int64_t r = 0; r < rows; ++r) {
    __m512 row_sum = _mm512_setzero_ps(), row_squares = _mm512_setzero_ps();
    for (int64_t p = 0; p < width; ++p) {
      const __m512 d = _mm512_sub_ps(_mm512_loadu_ps(plane + (r * width + p) * 16), k);
      row_sum = _mm512_add_ps(row_sum, d);
      row_squares = _mm512_fmadd_ps(d, d, row_squares);
    }
    sum_low = _mm512_add_pd(sum_low, _mm512_cvtps_pd(_mm512_castps512_ps256(row_sum)));
    sum_high = _mm512_add_pd(sum_high, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(
                                           _mm512_castps_pd(row_sum), 1))));
    squares_low = _mm512_add_pd(squares_low, _mm512_cvtps_pd(_mm512_castps512_ps256(row_squares)));
    squares_high = _mm512_add_pd(squares_high, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(
                                                   _mm512_castps_pd(row_squares), 1))));
  }
  _mm512_storeu_pd(sum, sum_low), _mm512_storeu_pd(sum + 8, sum_high);
  _mm512_storeu_pd(squares, squares_low), _mm512_storeu_pd(squares + 8, squares_high);
}
__attribute__((target("avx2,fma"))) void ChannelSumsAvx2(CHANNEL_SUMS_ARGS) {
  const __m256 k = _mm256_loadu_ps(shift);
  __m256d sum_low = _mm256_loadu_pd(sum), sum_high = _mm256_loadu_pd(sum + 4);
  __m256d squares_low = _mm256_loadu_pd(squares), squares_high = _mm256_loadu_pd(squares + 4);
  for (int64_t r = 0; r < rows; ++r) {
    __m256 row_sum = _mm256_setzero_ps(), row_squares = _mm256_setzero_ps();
    for (int64_t p = 0; p < width; ++p) {
      const __m256 d = _mm256_sub_ps(_mm256_loadu_ps(plane + (r * width + p) * 8), k);
      row_sum = _mm256_add_ps(row_sum, d);
      row_squares = _mm256_fmadd_ps(d, d, row_squares);
    }
    sum_low = _mm256_add_pd(sum_low, _mm256_cvtps_pd(_mm256_castps256_ps128(row_sum)));
    sum_high = _mm256_add_pd(sum_high, _mm256_cvtps_pd(_mm256_extractf128_ps(row_sum, 1)));
    squares_low = _mm256_add_pd(squares_low, _mm256_cvtps_pd(_mm256_castps256_ps128(row_squares)));
    squares_high = _mm256_add_pd(squares_high, _mm256_cvtps_pd(_mm256_extractf128_ps(row_squares, 1)));
  }
  _mm256_storeu_pd(sum, sum_low), _mm256_storeu_pd(sum + 4, sum_high);
  _mm256_storeu_pd(squares, squares_low), _mm256_storeu_pd(squares + 4, squares_high);
}
void ChannelSumsBaseline(CHANNEL_SUMS_ARGS) {
  for (int64_t r = 0; r < rows; ++r) {
    float row_sum[8] = {}, row_squares[8] = {};
    for (int64_t p = 0; p < width; ++p) {
      for (int b = 0; b < 8; ++b) {
        const float d = plane[(r * width + p) * 8 + b] - shift[b];
        row_sum[b] += d;
        row_squares[b] += d * d;
      }
    }
    for (int b = 0; b < 8; ++b) sum[b] += row_sum[b], squares[b] += row_squares[b];
  }
}

__attribute__((target("avx512f"))) void NormalizeAddReluAvx512(NORMALIZE_ADD_RELU_ARGS) {
  const __m512 m = _mm512_loadu_ps(mean), i = _mm512_loadu_ps(inverse), g = _mm512_loadu_ps(gamma);
  const __m512 b = _mm512_loadu_ps(beta);
  for (int64_t p = 0; p < pixels; ++p) {
    const __m512 centred = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + p * 16), m), i);
    const __m512 normalized = _mm512_fmadd_ps(centred, g, b);
    const __m512 sum = _mm512_add_ps(normalized, _mm512_loadu_ps(residual + p * 16));
    _mm512_storeu_ps(y + p * 16, _mm512_max_ps(_mm512_setzero_ps(), sum));  // NaN: max returns its second
  }
}
__attribute__((target("avx2,fma"))) void NormalizeAddReluAvx2(NORMALIZE_ADD_RELU_ARGS) {
  const __m256 m = _mm256_loadu_ps(mean), i = _mm256_loadu_ps(inverse), g = _mm256_loadu_ps(gamma);
  const __m256 b = _mm256_loadu_ps(beta);
  for (int64_t p = 0; p < pixels; ++p) {
    const __m256 centred = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + p * 8), m), i);
    const __m256 normalized = _mm256_fmadd_ps(centred, g, b);
    const __m256 sum = _mm256_add_ps(normalized, _mm256_loadu_ps(residual + p * 8));
    _mm256_storeu_ps(y + p * 8, _mm256_max_ps(_mm256_setzero_ps(), sum));
  }
}
void NormalizeAddReluBaseline(NORMALIZE_ADD_RELU_ARGS) {
  for (int64_t p = 0; p < pixels; ++p) {
    for (int b = 0; b < 8; ++b) {
      const float sum = (x[p * 8 + b] - mean[b]) * inverse[b] * gamma[b] + beta[b] + residual[p * 8 + b];
      y[p * 8 + b] = sum < 0.0f ? 0.0f : sum;
    }
  }
}

AddReluPassFunction AddReluPass() {
  static const auto pass = ChooseStep(AddReluPassAvx512, AddReluPassAvx2, AddReluPassBaseline);
  return pass;
}

template <typename Pass>
Pass ChooseBlockVariant(Pass avx512, Pass avx2, Pass baseline) {
  return ChannelBlock() == 16 ? avx512 : StepVectorBits() >= 256 ? avx2 : baseline;
}

void BatchNormAddRelu(dnnl::threadpool_interop::threadpool_iface &pool, const memory::dims &dims, float eps,
                      const float *t, const float *residual, const float *gamma, const float *beta, float *mean,
                      float *variance, float *y) {
  static const auto sums = ChooseBlockVariant(ChannelSumsAvx512, ChannelSumsAvx2, ChannelSumsBaseline);
  static const auto normalize =
      ChooseBlockVariant(NormalizeAddReluAvx512, NormalizeAddReluAvx2, NormalizeAddReluBaseline);
  const int64_t block = ChannelBlock(), channels = dims[1], blocks = channels / block, planes = dims[0] * blocks;
  const int64_t pixels = dims[2] * dims[3];
  const int used = static_cast<int>(std::min<int64_t>(pool.get_num_threads(), planes));
  std::vector<float> shift(channels), inverse(channels);
  for (int64_t c = 0; c < channels; ++c) shift[c] = t[c / block * pixels * block + c % block];
  std::vector<double> partial(2 * used * channels, 0.0);  // each thread's sums, then its sums of squares
  pool.parallel_for(used, [&](int thread, int) {
    double *sum = partial.data() + 2 * thread * channels, *squares = sum + channels;
    for (int64_t p = planes * thread / used; p < planes * (thread + 1) / used; ++p) {
      const int64_t first = p % blocks * block;
      sums(t + p * pixels * block, dims[2], dims[3], shift.data() + first, sum + first, squares + first);
    }
  });
  const double count = static_cast<double>(dims[0] * pixels);
  for (int64_t c = 0; c < channels; ++c) {
    double sum = 0.0, squares = 0.0;
    for (int thread = 0; thread < used; ++thread) {
      sum += partial[2 * thread * channels + c];
      squares += partial[(2 * thread + 1) * channels + c];
    }
    const double offset = sum / count;  // the mean less the shift
    mean[c] = static_cast<float>(shift[c] + offset);
    variance[c] = static_cast<float>(std::max(0.0, squares / count - offset * offset));
    inverse[c] = 1.0f / std::sqrt(variance[c] + eps);
  }
  pool.parallel_for(used, [&](int thread, int) {
    for (int64_t p = planes * thread / used; p < planes * (thread + 1) / used; ++p) {
      const int64_t first = p % blocks * block, at = p * pixels * block;
      normalize(t + at, residual + at, mean + first, inverse.data() + first, gamma + first, beta + first, y + at,
                pixels);
    }
  });
}

// One block of B output channels of an ABcd{B}b{B}a weight gradient ([in block][tap][in][out] within it) in OIHW
// order ([out][in][tap]): the rows of the plain tensor it holds. Cache-sized, so the scattered stores stay in cache.
#define BLOCK_TO_ROWS_ARGS const float *__restrict src, float *__restrict dst, int64_t in_blocks, int64_t taps
#define BLOCK_TO_ROWS_LOOP(B)                                                              \
  const int64_t row = in_blocks * B * taps;                                                \
  for (int64_t ib = 0; ib < in_blocks; ++ib) {                                             \
    for (int64_t t = 0; t < taps; ++t) {                                                   \
      const float *tile = src + (ib * taps + t) * B * B;                                   \
      float *out = dst + ib * B * taps + t;                                                \
      for (int o = 0; o < B; ++o) {                                                        \
        for (int i = 0; i < B; ++i) out[o * row + i * taps] = tile[i * B + o];             \
      }                                                                                    \
    }                                                                                      \
  }
__attribute__((target("avx512f"), optimize("O3"))) void BlockToRows16Loop(BLOCK_TO_ROWS_ARGS) { BLOCK_TO_ROWS_LOOP(16) }
// 1x1 kernels (one tap), the most of these gradients: each 16x16 tile transposed in registers and stored as 16
// whole row pieces, about four times the loop's rate.
__attribute__((target("avx512f"), optimize("O3"))) void BlockToRows16Avx512(BLOCK_TO_ROWS_ARGS) {
  if (taps != 1) return BlockToRows16Loop(src, dst, in_blocks, taps);
  const int64_t row = in_blocks * 16;
  for (int64_t ib = 0; ib < in_blocks; ++ib) {
    const float *tile = src + ib * 256;
    __m512 r[16], a[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(tile + i * 16);
    for (int i = 0; i < 16; i += 2) {
      a[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
      a[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
      r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a[i]), _mm512_castps_pd(a[i + 2])));
      r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a[i]), _mm512_castps_pd(a[i + 2])));
      r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a[i + 1]), _mm512_castps_pd(a[i + 3])));
      r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a[i + 1]), _mm512_castps_pd(a[i + 3])));
    }
    for (int i = 0; i < 16; i += 8) {
      for (int j = 0; j < 4; ++j) {
        a[i + j] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0x88);
        a[i + j + 4] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0xdd);
      }
    }
    for (int j = 0; j < 8; ++j) {
      r[j] = _mm512_shuffle_f32x4(a[j], a[j + 8], 0x88);
      r[j + 8] = _mm512_shuffle_f32x4(a[j], a[j + 8], 0xdd);
    }
    for (int o = 0; o < 16; ++o) _mm512_storeu_ps(dst + o * row + ib * 16, r[o]);
  }
}
__attribute__((optimize("O3"))) void BlockToRows16Baseline(BLOCK_TO_ROWS_ARGS) { BLOCK_TO_ROWS_LOOP(16) }
__attribute__((target("avx2"), optimize("O3"))) void BlockToRows8Avx2(BLOCK_TO_ROWS_ARGS) { BLOCK_TO_ROWS_LOOP(8) }
__attribute__((optimize("O3"))) void BlockToRows8Baseline(BLOCK_TO_ROWS_ARGS) { BLOCK_TO_ROWS_LOOP(8) }

void BlockToRows(int block, const float *src, float *dst, int64_t in_channels, int64_t taps) {
  static const auto rows16 = StepVectorBits() == 512 ? BlockToRows16Avx512 : BlockToRows16Baseline;
  static const auto rows8 = StepVectorBits() >= 256 ? BlockToRows8Avx2 : BlockToRows8Baseline;
  (block == 16 ? rows16 : rows8)(src, dst, in_channels / block, taps);
}

// An optimizer update's inputs: `scalars` float32 values (one each), the decays (float32, one per parameter), the
// gradients' layouts (int64, one per parameter: 1 where its gradient may come in a layout of its own, to take from
// GradientLayouts, else 0), then `parts` lists of n float32 tensors (weights first, the gradients last, the state
// between, each the weight's size), then the output (float32 [1]). Checks them and splits the work into chunks
// small enough to balance two or more threads and large enough to stream; a gradient in a kernel's layout is read
// one block of output channels at a time, a window's a run of whole kernels at a time.
struct UpdatePlan {
  static constexpr int64_t kChunkElements = 1 << 16;
  struct Chunk {
    int k;  // parameter
    int64_t first, count;  // elements
  };
  int n = 0;
  const float *decays = nullptr;
  const float *const *gradients = nullptr;
  std::vector<int64_t> sizes;
  std::vector<GradientLayout> layouts;  // per parameter: its gradient's (plain OIHW where both are 0)
  std::vector<int64_t> in_channels, taps, kernel_width;
  std::vector<Chunk> chunks;

  bool Read(const char *what, int scalars, int parts, int nparam, int *ndims, int64_t **shapes,
            const char **dtypes, void **params) {
    const int tensors = nparam - scalars - 3;
    if (tensors <= 0 || tensors % parts != 0) {
      std::fprintf(stderr,
                   "%s: expected %d scalars, decays, gradient layouts, %d x n tensors and an output, got %d tensors\n",
                   what, scalars, parts, nparam);
      return false;
    }
    n = tensors / parts;
    for (int i = 0; i < nparam; ++i) {
      const char *wanted = i == scalars + 1 ? "int64" : "float32";
      if (std::strcmp(dtypes[i], wanted) != 0) {
        std::fprintf(stderr, "%s: tensor %d must be %s, got %s\n", what, i, wanted, dtypes[i]);
        return false;
      }
    }
    auto elements = [&](int i) {
      int64_t count = 1;
      for (int d = 0; d < ndims[i]; ++d) count *= shapes[i][d];
      return count;
    };
    for (int i = 0; i < scalars; ++i) {
      if (elements(i) != 1) {
        std::fprintf(stderr, "%s: input %d must hold one value, got %lld\n", what, i,
                     static_cast<long long>(elements(i)));
        return false;
      }
    }
    if (elements(scalars) != n || elements(scalars + 1) != n) {
      std::fprintf(stderr, "%s: decays and gradient layouts must hold %d values each, got %lld and %lld\n", what, n,
                   static_cast<long long>(elements(scalars)), static_cast<long long>(elements(scalars + 1)));
      return false;
    }
    decays = static_cast<const float *>(params[scalars]);
    const auto *kernel_layouts = static_cast<const int64_t *>(params[scalars + 1]);
    const int first_weight = scalars + 2;
    gradients = reinterpret_cast<const float *const *>(params + first_weight + (parts - 1) * n);
    sizes.resize(n), layouts.assign(n, {}), in_channels.assign(n, 0), taps.assign(n, 0), kernel_width.assign(n, 0);
    for (int k = 0; k < n; ++k) {
      sizes[k] = elements(first_weight + k);
      for (int part = 1; part < parts; ++part) {
        if (elements(first_weight + part * n + k) != sizes[k]) {
          std::fprintf(stderr, "%s: parameter %d's state and gradient differ in size from it\n", what, k);
          return false;
        }
      }
      const GradientLayout layout = kernel_layouts[k] == 1 ? GradientLayouts::Take(params[first_weight + k])
                                                           : GradientLayout{};
      const int block = layout.block;
      const int64_t *shape = shapes[first_weight + k];
      const bool four = ndims[first_weight + k] == 4;
      if (block && (!four || shape[0] % block != 0 || shape[1] % block != 0)) {
        std::fprintf(stderr, "%s: parameter %d's gradient came in channel blocks of %d, which its shape can't hold\n",
                     what, k, block);
        return false;
      }
      if (layout.window_rows &&
          (!four || layout.window_rows > shape[2] || layout.window_cols > shape[3] ||
           layout.window_first + (layout.window_rows - 1) * shape[3] + layout.window_cols > shape[2] * shape[3])) {
        std::fprintf(stderr, "%s: parameter %d's gradient came as a window its kernels can't hold\n", what, k);
        return false;
      }
      layouts[k] = layout;
      if (four) in_channels[k] = shape[1], taps[k] = shape[2] * shape[3], kernel_width[k] = shape[3];
    }
    GradientLayouts::Clear();
    for (int k = 0; k < n; ++k) {
      const int64_t step = layouts[k].block ? layouts[k].block * in_channels[k] * taps[k]
                           : layouts[k].window_rows ? std::max<int64_t>(1, kChunkElements / taps[k]) * taps[k]
                                                    : kChunkElements;
      for (int64_t first = 0; first < sizes[k]; first += step) {
        chunks.push_back({k, first, std::min(sizes[k] - first, step)});
      }
    }
    return true;
  }

  // Runs step(parameter, first element, element count, its gradient in OIHW order) over every chunk on the pool,
  // then zeroes the output.
  template <typename Step>
  int Run(const char *what, void *output, Step step) const {
    return Guarded(what, [&] {
      auto &executor = Executor::Get();
      auto lock = executor.Begin();
      executor.pool.parallel_for(static_cast<int>(chunks.size()), [&](int index, int) {
        const Chunk &chunk = chunks[index];
        const GradientLayout &layout = layouts[chunk.k];
        const float *gradient = gradients[chunk.k] + chunk.first;
        thread_local std::vector<float> rows;
        if (layout.window_rows) {
          // A few kernels at a time, through the L1: the update's other streams would evict a larger run.
          const int64_t kernel_taps = taps[chunk.k], step_kernels = std::max<int64_t>(1, 4096 / kernel_taps);
          rows.resize(step_kernels * kernel_taps);
          for (int64_t done = 0; done < chunk.count; done += step_kernels * kernel_taps) {
            const int64_t count = std::min(chunk.count - done, step_kernels * kernel_taps);
            WindowToKernels(layout, gradients[chunk.k], (chunk.first + done) / kernel_taps, count / kernel_taps,
                            kernel_taps, kernel_width[chunk.k], rows.data());
            step(chunk.k, chunk.first + done, count, rows.data());
          }
          return;
        }
        if (layout.block) {
          rows.resize(chunk.count);
          BlockToRows(layout.block, gradient, rows.data(), in_channels[chunk.k], taps[chunk.k]);
          gradient = rows.data();
        }
        step(chunk.k, chunk.first, chunk.count, gradient);
      });
      *static_cast<float *>(output) = 0.0f;
    });
  }
};

float Scalar(void **params, int i) { return *static_cast<const float *>(params[i]); }

// Adam with L2 weight decay over every parameter in one pass, in place: what MindSpore's nn.Adam computes with
// its decay (gradient + decay * weight, an addition and a multiplication per parameter, each a pass over memory)
// before its Adam kernel, as one read of weight, gradient and moments and one write of weight and moments.
// params: lr, beta1, beta2, eps, beta1_power, beta2_power (the powers after this step's update), decays, gradient
// layouts, then n weights, n first moments, n second moments, n gradients, then the output (set to 0).
int LaunchAdamUpdate(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  const char *what = "onednn_conv adam update";
  constexpr int kScalars = 6, kParts = 4;
  UpdatePlan plan;
  if (!plan.Read(what, kScalars, kParts, nparam, ndims, shapes, dtypes, params)) return 1;
  const float lr = Scalar(params, 0), beta1 = Scalar(params, 1), beta2 = Scalar(params, 2), eps = Scalar(params, 3);
  // MindSpore's Adam kernel: the bias corrections folded into the step size, eps added to sqrt(v) uncorrected.
  const float step = lr * std::sqrt(1.0f - Scalar(params, 5)) / (1.0f - Scalar(params, 4));
  static const auto adam_step = ChooseStep(AdamStepAvx512, AdamStepAvx2, AdamStepBaseline);
  const int n = plan.n;
  return plan.Run(what, params[nparam - 1], [&](int k, int64_t first, int64_t count, const float *gradient) {
    auto tensor = [&](int part) { return static_cast<float *>(params[kScalars + 2 + part * n + k]) + first; };
    adam_step(tensor(0), tensor(1), tensor(2), gradient, count, plan.decays[k], beta1, beta2, eps, step);
  });
}

// params: kInputs float32 (N, C, H, W) tensors of one shape, then the output of that shape: out = pass(inputs...),
// element-wise on the pool's threads (AddRelu: a, b -> y; ReluGradient: dy, y -> dx; ReluGradientOfSum: da, db, y ->
// dx).
template <int kInputs, class Pass>
int LaunchElementwise(const char *what, Pass pass, int nparam, void **params, int *ndims, int64_t **shapes,
                      const char **dtypes) {
  static_assert(kInputs == 2 || kInputs == 3, "two or three inputs");
  int wanted_ndims[kInputs + 1];
  const char *wanted_dtypes[kInputs + 1];
  for (int i = 0; i <= kInputs; ++i) wanted_ndims[i] = 4, wanted_dtypes[i] = "float32";
  if (!CheckTensors(what, nparam, kInputs + 1, ndims, dtypes, wanted_ndims, wanted_dtypes)) return 1;
  for (int i = 1; i <= kInputs; ++i) {
    if (Dims(shapes[i]) != Dims(shapes[0])) {
      std::fprintf(stderr, "%s: the inputs and the output must have one shape\n", what);
      return 1;
    }
  }
  const memory::dims dims = Dims(shapes[0]);
  const int64_t count = dims[0] * dims[1] * dims[2] * dims[3];
  const float *in[kInputs];
  for (int i = 0; i < kInputs; ++i) in[i] = static_cast<const float *>(params[i]);
  float *out = static_cast<float *>(params[kInputs]);
  return Guarded(what, [&] {
    auto lock = Executor::Get().Begin();
    Runtime::Get().ForChunks(count, [&](int64_t begin, int64_t end) {
      if constexpr (kInputs == 2) {
        pass(in[0] + begin, in[1] + begin, out + begin, end - begin);
      } else {
        pass(in[0] + begin, in[1] + begin, in[2] + begin, out + begin, end - begin);
      }
    });
  });
}

// Momentum SGD with L2 weight decay in one pass, in place: nn.Momentum's decay and ApplyMomentum (nesterov
// false), or nn.SGD's decay and SGD kernel with nesterov (and its per-element first-step flags, stat).
// params: lr, momentum, decays, gradient layouts, then n weights, n accumulators, (nesterov: n stat tensors,) n
// gradients, output.
int LaunchMomentumUpdate(bool nesterov, int nparam, void **params, int *ndims, int64_t **shapes,
                         const char **dtypes) {
  const char *what = nesterov ? "onednn_conv nesterov sgd update" : "onednn_conv momentum update";
  constexpr int kScalars = 2;
  const int parts = nesterov ? 4 : 3;
  UpdatePlan plan;
  if (!plan.Read(what, kScalars, parts, nparam, ndims, shapes, dtypes, params)) return 1;
  const float lr = Scalar(params, 0), momentum = Scalar(params, 1);
  static const auto momentum_step = ChooseStep(MomentumStepAvx512, MomentumStepAvx2, MomentumStepBaseline);
  static const auto nesterov_step = ChooseStep(NesterovStepAvx512, NesterovStepAvx2, NesterovStepBaseline);
  const int n = plan.n;
  return plan.Run(what, params[nparam - 1], [&](int k, int64_t first, int64_t count, const float *gradient) {
    auto tensor = [&](int part) { return static_cast<float *>(params[kScalars + 2 + part * n + k]) + first; };
    if (nesterov) {
      nesterov_step(tensor(0), tensor(1), tensor(2), gradient, count, plan.decays[k], lr, momentum);
    } else {
      momentum_step(tensor(0), tensor(1), gradient, count, plan.decays[k], lr, momentum);
    }
  });
}

}  // namespace

#define ONEDNN_CONV_EXPORT(NAME, DIRECTION, STRIDE, PADDING)                                                    \
  extern "C" int NAME##_s##STRIDE##_p##PADDING(int nparam, void **params, int *ndims, int64_t **shapes,        \
                                                const char **dtypes, void *, void *) {                          \
    return Launch(Direction::DIRECTION, STRIDE, PADDING, nparam, params, ndims, shapes, dtypes);              \
  }
#define ONEDNN_CONV_EXPORT_ALL(STRIDE, PADDING)                              \
  ONEDNN_CONV_EXPORT(ConvForward, kForward, STRIDE, PADDING)                 \
  ONEDNN_CONV_EXPORT(ConvBackwardData, kBackwardData, STRIDE, PADDING)       \
  ONEDNN_CONV_EXPORT(ConvBackwardWeights, kBackwardWeights, STRIDE, PADDING)

// The (stride, padding) pairs of torchvision-style ResNets (1x1, 3x3 and the 7x7 stem) and a few more.
ONEDNN_CONV_EXPORT_ALL(1, 0)
ONEDNN_CONV_EXPORT_ALL(1, 1)
ONEDNN_CONV_EXPORT_ALL(1, 2)
ONEDNN_CONV_EXPORT_ALL(1, 3)
ONEDNN_CONV_EXPORT_ALL(2, 0)
ONEDNN_CONV_EXPORT_ALL(2, 1)
ONEDNN_CONV_EXPORT_ALL(2, 2)
ONEDNN_CONV_EXPORT_ALL(2, 3)

// Training: convolution + BatchNorm, forward and gradient, x (stride, padding).
#define ONEDNN_CONV_BN_EXPORT(STRIDE, PADDING)                                                                   \
  extern "C" int ConvBnForward_s##STRIDE##_p##PADDING(int nparam, void **params, int *ndims, int64_t **shapes,  \
                                                       const char **dtypes, void *, void *) {                    \
    return LaunchConvBnForward(STRIDE, PADDING, false, nparam, params, ndims, shapes, dtypes);                 \
  }                                                                                                              \
  extern "C" int ConvBnAddReluForward_s##STRIDE##_p##PADDING(int nparam, void **params, int *ndims,             \
                                                              int64_t **shapes, const char **dtypes, void *,     \
                                                              void *) {                                          \
    return LaunchConvBnForward(STRIDE, PADDING, true, nparam, params, ndims, shapes, dtypes);                  \
  }                                                                                                              \
  extern "C" int ConvBnBackward_s##STRIDE##_p##PADDING(int nparam, void **params, int *ndims, int64_t **shapes, \
                                                        const char **dtypes, void *, void *) {                   \
    return LaunchConvBnBackward(false, STRIDE, PADDING, nparam, params, ndims, shapes, dtypes);                \
  }                                                                                                              \
  extern "C" int ConvBnBackwardWeights_s##STRIDE##_p##PADDING(int nparam, void **params, int *ndims,            \
                                                               int64_t **shapes, const char **dtypes, void *,    \
                                                               void *) {                                         \
    return LaunchConvBnBackward(true, STRIDE, PADDING, nparam, params, ndims, shapes, dtypes);                 \
  }                                                                                                              \
  extern "C" int ConvBnBackwardData_s##STRIDE##_p##PADDING(int nparam, void **params, int *ndims,               \
                                                            int64_t **shapes, const char **dtypes, void *,       \
                                                            void *) {                                            \
    return LaunchConvBnBackwardData(STRIDE, PADDING, nparam, params, ndims, shapes, dtypes);                   \
  }

ONEDNN_CONV_BN_EXPORT(1, 0)
ONEDNN_CONV_BN_EXPORT(1, 1)
ONEDNN_CONV_BN_EXPORT(1, 2)
ONEDNN_CONV_BN_EXPORT(1, 3)
ONEDNN_CONV_BN_EXPORT(2, 0)
ONEDNN_CONV_BN_EXPORT(2, 1)
ONEDNN_CONV_BN_EXPORT(2, 2)
ONEDNN_CONV_BN_EXPORT(2, 3)

// Training: activations into and out of channel blocks (each the other's gradient).
extern "C" int ToBlocked(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *,
                         void *) {
  return LaunchReorder(true, nparam, params, ndims, shapes, dtypes);
}
extern "C" int FromBlocked(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *,
                           void *) {
  return LaunchReorder(false, nparam, params, ndims, shapes, dtypes);
}

// Inference: post-ops (None, Relu, AddRelu: residual addition then ReLU) x (stride, padding).
#define ONEDNN_INFERENCE_EXPORT(POST, STRIDE, PADDING)                                                         \
  extern "C" int ConvInference##POST##_s##STRIDE##_p##PADDING(int nparam, void **params, int *ndims,           \
                                                              int64_t **shapes, const char **dtypes, void *,   \
                                                              void *) {                                        \
    return LaunchInference(PostOp::k##POST, STRIDE, PADDING, nparam, params, ndims, shapes, dtypes);          \
  }
#define ONEDNN_INFERENCE_EXPORT_ALL(STRIDE, PADDING) \
  ONEDNN_INFERENCE_EXPORT(None, STRIDE, PADDING)     \
  ONEDNN_INFERENCE_EXPORT(Relu, STRIDE, PADDING)     \
  ONEDNN_INFERENCE_EXPORT(AddRelu, STRIDE, PADDING)

ONEDNN_INFERENCE_EXPORT_ALL(1, 0)
ONEDNN_INFERENCE_EXPORT_ALL(1, 1)
ONEDNN_INFERENCE_EXPORT_ALL(1, 2)
ONEDNN_INFERENCE_EXPORT_ALL(1, 3)
ONEDNN_INFERENCE_EXPORT_ALL(2, 0)
ONEDNN_INFERENCE_EXPORT_ALL(2, 1)
ONEDNN_INFERENCE_EXPORT_ALL(2, 2)
ONEDNN_INFERENCE_EXPORT_ALL(2, 3)

// The optimizer: Adam with L2 weight decay, in place (see LaunchAdamUpdate).
extern "C" int AdamUpdate(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *,
                          void *) {
  return LaunchAdamUpdate(nparam, params, ndims, shapes, dtypes);
}

// Momentum SGD as nn.Momentum computes it, and Nesterov SGD as nn.SGD does, in place (see LaunchMomentumUpdate).
extern "C" int MomentumUpdate(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *,
                              void *) {
  return LaunchMomentumUpdate(false, nparam, params, ndims, shapes, dtypes);
}
extern "C" int NesterovSgdUpdate(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                 void *, void *) {
  return LaunchMomentumUpdate(true, nparam, params, ndims, shapes, dtypes);
}

// Training: the residual addition and its ReLU, and their gradient (LaunchElementwise).
extern "C" int AddRelu(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *, void *) {
  return LaunchElementwise<2>("onednn_conv add and relu", AddReluPass(), nparam, params, ndims, shapes, dtypes);
}
extern "C" int ReluGradient(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *,
                            void *) {
  static const auto pass = ChooseStep(ReluGradientPassAvx512, ReluGradientPassAvx2, ReluGradientPassBaseline);
  return LaunchElementwise<2>("onednn_conv relu gradient", pass, nparam, params, ndims, shapes, dtypes);
}
extern "C" int ReluGradientOfSum(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                 void *, void *) {
  static const auto pass =
      ChooseStep(ReluGradientOfSumPassAvx512, ReluGradientOfSumPassAvx2, ReluGradientOfSumPassBaseline);
  return LaunchElementwise<3>("onednn_conv relu gradient of a sum", pass, nparam, params, ndims, shapes, dtypes);
}

// Inference: a stage of residual blocks in one call (LaunchStageInference).
extern "C" int StageInference(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *,
                              void *) {
  return LaunchStageInference(nparam, params, ndims, shapes, dtypes);
}

// ResNet's stem pool (kernel 3, stride 2, padding 1).
extern "C" int MaxPool_k3_s2_p1(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                    void *, void *) {
  return LaunchMaxPool(3, 2, 1, nparam, params, ndims, shapes, dtypes);
}

// Training: ReLU and ResNet's stem pool on channel blocks, and its gradient.
extern "C" int ReluMaxPool_k3_s2_p1(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                    void *, void *) {
  return LaunchReluMaxPoolForward(3, 2, 1, nparam, params, ndims, shapes, dtypes);
}
extern "C" int ReluMaxPoolGrad_k3_s2_p1(int nparam, void **params, int *ndims, int64_t **shapes,
                                        const char **dtypes, void *, void *) {
  return LaunchReluMaxPoolBackward(3, 2, 1, nparam, params, ndims, shapes, dtypes);
}

// Sets the pool's thread count (before the first convolution; later calls change nothing). Returns the count
// in use: the one set, or what the pool was built with.
extern "C" int onednn_conv_set_threads(int threads) {
  if (pool_threads.load() > 0) return pool_threads.load();
  if (threads > 0) requested_threads.store(threads);
  return ThreadCount();
}

// The vector width in bits (512, 256 or 128) the optimizer updates run with, for tests of the ISA cap.
extern "C" int onednn_conv_update_vector_bits() { return StepVectorBits(); }

// The ReLU mask's bytes for a conv+BatchNorm output of dims (n, c, h, w), for Python's shapes; -1 on error.
extern "C" int64_t onednn_conv_relu_mask_bytes(int64_t n, int64_t c, int64_t h, int64_t w) {
  try {
    return ReluMaskBytes({n, c, h, w});
  } catch (const std::exception &) {
    return -1;
  }
}

// The channel block of the blocked layouts (16 or 8), for Python's shapes and fallbacks.
extern "C" int onednn_conv_channel_block() { return ChannelBlock(); }

// Lets Python check that the loaded library was built from the source it is next to.
extern "C" const char *onednn_conv_source_digest() { return ONEDNN_CONV_SOURCE_DIGEST; }
