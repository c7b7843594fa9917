// Hopper (sm_90a) primitives of the attention kernels: shared-memory tiles in the 128-byte
// swizzled layout that wgmma reads, their matrix descriptors, the wgmma.mma_async shapes the
// kernels use, and the mbarrier / setmaxnreg pieces of a warp-specialised kernel. Written against
// the PTX ISA ("Asynchronous Warpgroup Level Matrix Multiply-Accumulate", "mbarrier") because
// the build depends on no CUTLASS/CuTe, which is where such wrappers usually come from.
//
// A warpgroup is 4 consecutive warps (128 threads) starting at a warp index divisible by 4. An
// m64nN product leaves its accumulators in the layout of mma.sync's m16n8 tiles stacked by warp:
// warp w of the group holds rows 16 w .. 16 w + 15, d[j][e] is row 16 w + lane / 4 + 8 (e / 2),
// column 8 j + 2 (lane % 4) + (e % 2). The A operand from registers has mma.sync's A fragment
// layout per warp, so attention_kernels.cuh's to_a_frags repacks scores for the next product.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace sparsebalance {
namespace kernels {
namespace sm90 {

// ---- 128-byte swizzled tiles -------------------------------------------------------------------
// A tile of ROWS rows x COLS 16-bit columns is stored as COLS / 64 slabs of ROWS x 64 values (one
// 128-byte line per row); inside a slab the 16-byte unit u of row r sits at unit u ^ (r % 8).
// This is the "128B swizzle" that wgmma's descriptors name. The hardware applies the XOR to
// address bits, so every tile starts 1024-byte aligned (8 lines), and the same tile can be read
// as a K-major operand (rows are M or N, columns are K) or an MN-major one (rows are K).
constexpr int SW_COLS = 64;     // 16-bit values per 128-byte line
constexpr int SW_ALIGN = 1024;  // bytes of one swizzle pattern (8 lines)

template <int ROWS>
__device__ __forceinline__ int sw128_offset(int r, int c) {
  return (c / SW_COLS) * ROWS * SW_COLS + r * SW_COLS + ((((c % SW_COLS) / 8) ^ (r % 8)) * 8) + c % 8;
}

// Shared-memory matrix descriptor of a 128-byte swizzled operand (PTX ISA "Matrix Descriptor
// Format"): start address, leading and stride byte offsets (all >> 4), swizzle mode 1 (128 B).
__device__ __forceinline__ uint64_t sw128_desc(const void* start, uint32_t lead_bytes, uint32_t stride_bytes) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(start));
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(lead_bytes >> 4) << 16) |
         ((uint64_t)(stride_bytes >> 4) << 32) | (1ull << 62);
}

// Descriptors of a whole tile, in the two readings: K-major (8-row groups 1024 bytes apart; the
// leading offset is unused when swizzled) and MN-major (rows of the tile are K: 8-row groups
// along K 1024 bytes apart, 64-column slabs along N one slab apart). Operands inside the tile
// are reached by adding to the start address field (desc_at), so each product of a loop costs
// one add rather than a new descriptor.
template <int ROWS>
__device__ __forceinline__ uint64_t kmajor_tile(const void* tile) {
  return sw128_desc(tile, 16, SW_ALIGN);
}
template <typename T, int ROWS>
__device__ __forceinline__ uint64_t mnmajor_tile(const T* tile) {
  return sw128_desc(tile, ROWS * SW_COLS * sizeof(T), SW_ALIGN);
}
// The descriptor `elems` 16-bit values past `desc`'s start (the field counts 16-byte units; tiles
// lie below 256 KB, so the 14-bit field never carries).
template <typename T>
__device__ __forceinline__ uint64_t desc_at(uint64_t desc, int elems) {
  return desc + (uint64_t)((elems * (int)sizeof(T)) >> 4);
}
// K-major operand: 16 values of K from column k, rows from row0, of a tile of ROWS rows.
template <typename T, int ROWS>
__device__ __forceinline__ uint64_t kmajor_at(uint64_t tile_desc, int row0, int k) {
  return desc_at<T>(tile_desc, (k / SW_COLS) * ROWS * SW_COLS + row0 * SW_COLS + k % SW_COLS);
}
// MN-major operand: K rows [k, k + 16), every column.
template <typename T>
__device__ __forceinline__ uint64_t mnmajor_at(uint64_t tile_desc, int k) {
  return desc_at<T>(tile_desc, k * SW_COLS);
}

// ---- Ordering ----------------------------------------------------------------------------------

// Before a warpgroup's first product of a batch: orders its earlier register writes (zeroed or
// repacked operands, accumulators touched by ordinary code) before the asynchronous reads.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Wait until at most N committed groups of this warpgroup are pending (groups complete in order).
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Shared memory written through the generic proxy (cp.async, plain stores) and read next by
// wgmma (the async proxy) needs this in each writing thread before the barrier.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// ---- Shared-memory barriers (mbarrier) between producer and consumer warps --------------------
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(bar))),
               "r"(count)
               : "memory");
}
// Makes the barrier's initialisation visible before any thread uses it (then a __syncthreads).
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(bar)))
               : "memory");
}
// Arrives when every cp.async this thread issued so far has landed; `noinc`: the arrival is one
// of the count the barrier was initialised with.
__device__ __forceinline__ void mbar_arrive_cp_async(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(bar)))
               : "memory");
}
// Blocks until the barrier's phase of this parity has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, int parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(bar))),
      "r"(parity)
      : "memory");
}
// Adds `bytes` to the transaction count that the barrier's current phase waits for, without
// arriving: the TMA copies below count their bytes down as they land.
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(bar))),
               "r"(bytes)
               : "memory");
}

// ---- TMA copies ----------------------------------------------------------------------------------
// The box at coordinates (c, h, t) of a 3-D tensor map (innermost first) into shared memory at
// dst, counted down on bar's transaction count. `map` is the address of a __grid_constant__
// kernel parameter (a CUtensorMap the host encoded). The map's swizzle writes the box in the
// 128-byte swizzled layout above, so dst is 1024-byte aligned.
__device__ __forceinline__ void tma_load_3d(void* dst, const void* map, int c, int h, int t, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
      "[%5];\n" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(dst))),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c), "r"(h), "r"(t),
      "r"(static_cast<uint32_t>(__cvta_generic_to_shared(bar)))
      : "memory");
}

// `bytes` contiguous bytes (a multiple of 16, both addresses 16-byte aligned) from global to
// shared memory by the bulk copy engine, counted down on bar's transaction count.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(dst))),
               "l"(src), "r"(bytes), "r"(static_cast<uint32_t>(__cvta_generic_to_shared(bar)))
               : "memory");
}

// The transpose of an 8 x 8 matrix of 16-bit values held by a warp as an mma fragment (lane l
// holds row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1), in the same layout.
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t a) {
  uint32_t d;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(d) : "r"(a));
  return d;
}

// Moves registers from the warpgroup that loads to the ones that multiply (sm_90a).
template <int N>
__device__ __forceinline__ void regs_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <int N>
__device__ __forceinline__ void regs_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }

// ---- Products ------------------------------------------------------------------------------------
// Operand lists of the accumulators (written out because inline asm takes no arrays).
// 32 accumulator registers of an m64n64 tile, as asm operands %0..%31
#define SPARSEBALANCE_ACC64(d) \
  "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), \
  "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), \
  "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), \
  "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), \
  "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
#define SPARSEBALANCE_REGS64 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20," \
  "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"

// 64 accumulator registers of an m64n128 tile, as asm operands %0..%63
#define SPARSEBALANCE_ACC128(d) \
  "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), \
  "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), \
  "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), \
  "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), \
  "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), \
  "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), \
  "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), \
  "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), \
  "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), \
  "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
#define SPARSEBALANCE_REGS128 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20," \
  "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39," \
  "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58," \
  "%59, %60, %61, %62, %63"

// d (+)= A B, A and B K-major in shared memory (descriptors). `accumulate` false overwrites d.
#define SPARSEBALANCE_WGMMA_SS(N, TYPE, DA, DB, SCALE)                                                   \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE ", 0;\n"                                    \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " {" SPARSEBALANCE_REGS##N \
               "}, " DA ", " DB ", p, 1, 1, 0, 0;\n}\n"                                                 \
               : SPARSEBALANCE_ACC##N(d)                                                                \
               : "l"(desc_a), "l"(desc_b), "r"(int(accumulate)))
// d (+)= A B, A from registers (mma.sync A fragments), B in shared memory: K-major, or MN-major
// (read transposed) where `transposed_b`, an immediate operand.
#define SPARSEBALANCE_WGMMA_RS(N, TYPE, A0, A1, A2, A3, DB, SCALE, TNSP_B)                              \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE ", 0;\n"                                    \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " {" SPARSEBALANCE_REGS##N \
               "}, {" A0 ", " A1 ", " A2 ", " A3 "}, " DB ", p, 1, 1, " TNSP_B ";\n}\n"                \
               : SPARSEBALANCE_ACC##N(d)                                                                \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(int(accumulate)),           \
                 "n"(int(transposed_b)))

template <typename T>
constexpr bool is_bf16() {
  static_assert(std::is_same<T, __nv_bfloat16>::value || std::is_same<T, __half>::value, "bf16 or fp16");
  return std::is_same<T, __nv_bfloat16>::value;
}

template <typename T, int N>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 8][4], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
  static_assert(N == 64 || N == 128, "wgmma_ss: N is 64 or 128");
  if constexpr (N == 64) {
    if constexpr (is_bf16<T>())
      SPARSEBALANCE_WGMMA_SS(64, "bf16", "%32", "%33", "%34");
    else
      SPARSEBALANCE_WGMMA_SS(64, "f16", "%32", "%33", "%34");
  } else {
    if constexpr (is_bf16<T>())
      SPARSEBALANCE_WGMMA_SS(128, "bf16", "%64", "%65", "%66");
    else
      SPARSEBALANCE_WGMMA_SS(128, "f16", "%64", "%65", "%66");
  }
}

// A from registers, B K-major (wgmma_rs) or MN-major (wgmma_rs_tb).
template <typename T, int N, bool transposed_b>
__device__ __forceinline__ void wgmma_rs_any(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t desc_b,
                                             bool accumulate) {
  static_assert(N == 64 || N == 128, "wgmma_rs: N is 64 or 128");
  if constexpr (N == 64) {
    if constexpr (is_bf16<T>())
      SPARSEBALANCE_WGMMA_RS(64, "bf16", "%32", "%33", "%34", "%35", "%36", "%37", "%38");
    else
      SPARSEBALANCE_WGMMA_RS(64, "f16", "%32", "%33", "%34", "%35", "%36", "%37", "%38");
  } else {
    if constexpr (is_bf16<T>())
      SPARSEBALANCE_WGMMA_RS(128, "bf16", "%64", "%65", "%66", "%67", "%68", "%69", "%70");
    else
      SPARSEBALANCE_WGMMA_RS(128, "f16", "%64", "%65", "%66", "%67", "%68", "%69", "%70");
  }
}
template <typename T, int N>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t desc_b,
                                         bool accumulate) {
  wgmma_rs_any<T, N, false>(d, a, desc_b, accumulate);
}
template <typename T, int N>
__device__ __forceinline__ void wgmma_rs_tb(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t desc_b,
                                            bool accumulate) {
  wgmma_rs_any<T, N, true>(d, a, desc_b, accumulate);
}

#undef SPARSEBALANCE_WGMMA_SS
#undef SPARSEBALANCE_WGMMA_RS
#undef SPARSEBALANCE_ACC64
#undef SPARSEBALANCE_ACC128
#undef SPARSEBALANCE_REGS64
#undef SPARSEBALANCE_REGS128

}  // namespace sm90
}  // namespace kernels
}  // namespace sparsebalance
