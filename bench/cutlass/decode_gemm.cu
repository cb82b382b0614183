// CUTLASS 3 Hopper GEMMs for bench/decode_gemm_cutlass.py: D (M, N) = A (M, K) B (N, K)^T in bf16, float32
// accumulation, warp-specialized cooperative kernels with the sm90 stream-K tile scheduler (data-parallel, split-K,
// stream-K or CUTLASS's heuristic chosen per call). A C ABI so that Python loads it with ctypes (no torch headers:
// the .so does not depend on the torch it runs beside). Build (nvcc 12.x/13.x, CUTLASS 3/4 headers):
//   nvcc -std=c++17 -O3 -DNDEBUG -arch=sm_90a --expt-relaxed-constexpr -shared -Xcompiler -fPIC \
//        -I$CUTLASS/include -I$CUTLASS/tools/util/include -o decode_gemm.so decode_gemm.cu -cudart static
#include <cuda_runtime.h>
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"
#include "cutlass/util/packed_stride.hpp"

using namespace cute;

template <class TileShape, class ClusterShape>
struct Config {
  using Element = cutlass::bfloat16_t;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, cutlass::layout::RowMajor, 8,
      Element, cutlass::layout::RowMajor, 8,
      cutlass::epilogue::TmaWarpSpecializedCooperative>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      Element, cutlass::layout::RowMajor, 8,
      Element, cutlass::layout::ColumnMajor, 8,
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop,
                                                          CollectiveEpilogue, cutlass::gemm::StreamKScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
};

using C0 = Config<Shape<_128, _128, _64>, Shape<_2, _1, _1>>;   // two M tiles share each W tile (TMA multicast)
using C1 = Config<Shape<_128, _128, _64>, Shape<_1, _1, _1>>;
using C2 = Config<Shape<_128, _256, _64>, Shape<_2, _1, _1>>;

template <class Cfg>
static typename Cfg::Gemm::Arguments make_args(const void* a, const void* b, void* d, int M, int N, int K, int mode,
                                               int splits, int sms) {
  using Gemm = typename Cfg::Gemm;
  using StrideA = typename Gemm::GemmKernel::StrideA;
  using StrideB = typename Gemm::GemmKernel::StrideB;
  using StrideC = typename Gemm::GemmKernel::StrideC;
  using StrideD = typename Gemm::GemmKernel::StrideD;
  using E = typename Cfg::Element;
  cutlass::KernelHardwareInfo hw;
  hw.device_id = 0;
  hw.sm_count = sms;
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {M, N, K, 1},
      {static_cast<const E*>(a), cutlass::make_cute_packed_stride(StrideA{}, make_shape(M, K, 1)),
       static_cast<const E*>(b), cutlass::make_cute_packed_stride(StrideB{}, make_shape(N, K, 1))},
      {{1.0f, 0.0f}, nullptr, cutlass::make_cute_packed_stride(StrideC{}, make_shape(M, N, 1)),
       static_cast<E*>(d), cutlass::make_cute_packed_stride(StrideD{}, make_shape(M, N, 1))},
      hw};
  args.scheduler.decomposition_mode = static_cast<cutlass::gemm::kernel::detail::DecompositionMode>(mode);
  args.scheduler.reduction_mode = cutlass::gemm::kernel::detail::ReductionMode::Deterministic;
  args.scheduler.splits = splits;
  return args;
}

template <class Cfg>
static size_t workspace(int M, int N, int K, int mode, int splits, int sms) {
  auto args = make_args<Cfg>(nullptr, nullptr, nullptr, M, N, K, mode, splits, sms);
  return Cfg::Gemm::get_workspace_size(args);
}

template <class Cfg>
static int run(const void* a, const void* b, void* d, int M, int N, int K, int mode, int splits, int sms, void* ws,
               cudaStream_t stream) {
  typename Cfg::Gemm gemm;
  auto args = make_args<Cfg>(a, b, d, M, N, K, mode, splits, sms);
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return 1;
  if (gemm.initialize(args, ws, stream) != cutlass::Status::kSuccess) return 2;
  if (gemm.run(stream) != cutlass::Status::kSuccess) return 3;
  return static_cast<int>(cudaGetLastError());
}

// config: 0 = 128x128 tiles, 2x1 cluster; 1 = 128x128, no cluster; 2 = 128x256, 2x1 cluster.
// mode: the scheduler's DecompositionMode (0 Heuristic, 1 DataParallel, 2 SplitK, 3 StreamK, as CUTLASS numbers them).
extern "C" size_t lathe_gemm_workspace(int config, int M, int N, int K, int mode, int splits, int sms) {
  switch (config) {
    case 0: return workspace<C0>(M, N, K, mode, splits, sms);
    case 1: return workspace<C1>(M, N, K, mode, splits, sms);
    default: return workspace<C2>(M, N, K, mode, splits, sms);
  }
}

extern "C" int lathe_gemm(int config, const void* a, const void* b, void* d, int M, int N, int K, int mode, int splits,
                          int sms, void* ws, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  switch (config) {
    case 0: return run<C0>(a, b, d, M, N, K, mode, splits, sms, ws, s);
    case 1: return run<C1>(a, b, d, M, N, K, mode, splits, sms, ws, s);
    default: return run<C2>(a, b, d, M, N, K, mode, splits, sms, ws, s);
  }
}

// A prepared call: the kernel's parameters built once (`initialize`), each launch only `run` (no host work, no
// workspace memset). For a data-parallel decomposition, which needs no workspace between launches. Never freed: the
// handles live as long as the bench that made them.
struct Prepared {
  int config;
  void* gemm;
};

template <class Cfg>
static void* prepare(const void* a, const void* b, void* d, int M, int N, int K, int mode, int splits, int sms, void* ws,
                     cudaStream_t stream) {
  auto* gemm = new typename Cfg::Gemm();
  auto args = make_args<Cfg>(a, b, d, M, N, K, mode, splits, sms);
  if (gemm->can_implement(args) != cutlass::Status::kSuccess ||
      gemm->initialize(args, ws, stream) != cutlass::Status::kSuccess) {
    delete gemm;
    return nullptr;
  }
  return gemm;
}

extern "C" void* lathe_gemm_prepare(int config, const void* a, const void* b, void* d, int M, int N, int K, int mode,
                                    int splits, int sms, void* ws, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  void* g = config == 0 ? prepare<C0>(a, b, d, M, N, K, mode, splits, sms, ws, s)
          : config == 1 ? prepare<C1>(a, b, d, M, N, K, mode, splits, sms, ws, s)
                        : prepare<C2>(a, b, d, M, N, K, mode, splits, sms, ws, s);
  return g ? new Prepared{config, g} : nullptr;
}

extern "C" int lathe_gemm_launch(void* handle, void* stream) {
  auto* p = static_cast<Prepared*>(handle);
  auto s = static_cast<cudaStream_t>(stream);
  cutlass::Status st = p->config == 0 ? static_cast<C0::Gemm*>(p->gemm)->run(s)
                     : p->config == 1 ? static_cast<C1::Gemm*>(p->gemm)->run(s)
                                      : static_cast<C2::Gemm*>(p->gemm)->run(s);
  return st == cutlass::Status::kSuccess ? static_cast<int>(cudaGetLastError()) : 3;
}
