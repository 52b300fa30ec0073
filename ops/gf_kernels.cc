// Conversion, accumulation and sharding helpers for the GradientFlow kernels.
//
// The vector code is compiled for AVX2+F16C through function target
// attributes only and chosen at run time (CpuHasSimd), so the library loads
// and runs on any x86-64 CPU; everything has a scalar twin used otherwise (and
// by tests, through the ops' `simd=false` attribute).
#include "gf_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define GF_TF_X86 1
#endif

#include "tensorflow/core/framework/numeric_types.h"
#include "tensorflow/core/util/work_sharder.h"

namespace gf_tf {

using tensorflow::DT_BFLOAT16;
using tensorflow::DT_DOUBLE;
using tensorflow::DT_FLOAT;
using tensorflow::DT_HALF;

namespace {

// Elements converted per step when a conversion goes through a float buffer
// on the stack (16 KB: stays in L1).
constexpr int64_t kBlock = 4096;

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// ---------------------------------------------------------------------------
// Scalar conversions.
// ---------------------------------------------------------------------------

inline uint16_t FloatToHalfBits(float f) {
  return Eigen::numext::bit_cast<uint16_t>(Eigen::half(f));
}
inline float HalfBitsToFloat(uint16_t h) {
  return static_cast<float>(Eigen::numext::bit_cast<Eigen::half>(h));
}
inline uint16_t FloatToBf16Bits(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x0040u;  // quiet NaN
  // Round to nearest even; a carry out of the mantissa gives the next
  // exponent, and past the largest finite value, inf.
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float Bf16BitsToFloat(uint16_t b) {
  return BitsFloat(static_cast<uint32_t>(b) << 16);
}

// Rounds d to float toward zero and sets the last mantissa bit if inexact
// ("round to odd"). Rounding that float to half or bfloat16 (nearest even)
// then equals rounding d directly: float keeps more than 2 extra bits.
inline float DoubleToFloatRoundToOdd(double d) {
  float f = static_cast<float>(d);
  double back = static_cast<double>(f);
  if (back == d || std::isnan(d)) return f;
  uint32_t u = FloatBits(f);
  if (std::fabs(back) > std::fabs(d)) u -= 1;  // step toward zero
  return BitsFloat(u | 1u);
}

void F32ToHalfScalar(const float* src, uint16_t* dst, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) dst[i] = FloatToHalfBits(src[i] * scale);
}
void F32ToBf16Scalar(const float* src, uint16_t* dst, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) dst[i] = FloatToBf16Bits(src[i] * scale);
}
void F32ScaleScalar(const float* src, float* dst, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i] * scale;
}
void HalfToF32Scalar(const uint16_t* src, float* dst, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) dst[i] = HalfBitsToFloat(src[i]) * scale;
}
void Bf16ToF32Scalar(const uint16_t* src, float* dst, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) dst[i] = Bf16BitsToFloat(src[i]) * scale;
}

// Largest value of bits & mask: the largest |x| by bit pattern (see AbsMax).
template <typename Bits>
Bits MaxMaskedScalar(const Bits* src, int64_t n, Bits mask) {
  Bits m = 0;
  for (int64_t i = 0; i < n; ++i) m = std::max<Bits>(m, src[i] & mask);
  return m;
}

// See AccumulateSegment; `lookahead` (or nullptr): += sum |a + momentum * u|.
double AccumulateF32Scalar(const float* r, const float* g, const float* v,
                           float* v_out, float momentum, float* acc, int64_t n,
                           double* lookahead) {
  double l1 = 0.0, ahead = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    float u = g[i];
    if (v != nullptr) {
      u = momentum * v[i] + u;
      v_out[i] = u;
    }
    float a = r[i] + u;
    acc[i] = a;
    l1 += std::fabs(a);
    if (lookahead != nullptr) {
      const float next = momentum * u;
      ahead += std::fabs(a + next);
    }
  }
  if (lookahead != nullptr) *lookahead += ahead;
  return l1;
}

// ---------------------------------------------------------------------------
// AVX2 + F16C versions (no FMA, so results match the scalar code bit for bit).
// ---------------------------------------------------------------------------
#ifdef GF_TF_X86
#define GF_TF_SIMD __attribute__((target("avx2,f16c")))

GF_TF_SIMD void F32ToHalfSimd(const float* src, uint16_t* dst, int64_t n,
                              float scale) {
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 x = _mm256_mul_ps(_mm256_loadu_ps(src + i), s);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  F32ToHalfScalar(src + i, dst + i, n - i, scale);
}

GF_TF_SIMD inline __m256i Bf16Round8(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
  const __m256i quiet_nan =
      _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
  const __m256 is_nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  return _mm256_blendv_epi8(rounded, quiet_nan, _mm256_castps_si256(is_nan));
}

GF_TF_SIMD void F32ToBf16Simd(const float* src, uint16_t* dst, int64_t n,
                              float scale) {
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256i lo = Bf16Round8(_mm256_mul_ps(_mm256_loadu_ps(src + i), s));
    __m256i hi = Bf16Round8(_mm256_mul_ps(_mm256_loadu_ps(src + i + 8), s));
    // packus works within 128-bit lanes: reorder the 64-bit quarters.
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xd8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), packed);
  }
  F32ToBf16Scalar(src + i, dst + i, n - i, scale);
}

// Elements to handle one by one before dst is 32-byte aligned (for streaming stores).
inline int64_t HeadToAlign(const void* dst, int elem_bytes, int64_t n) {
  const uintptr_t misaligned = reinterpret_cast<uintptr_t>(dst) & 31;
  if (misaligned == 0) return 0;
  if (misaligned % elem_bytes != 0) return n;  // never for TensorFlow buffers
  return std::min<int64_t>(n, (32 - misaligned) / elem_bytes);
}

template <bool kStream>
GF_TF_SIMD inline void StoreF32(float* p, __m256 x) {
  if (kStream) {
    _mm256_stream_ps(p, x);
  } else {
    _mm256_storeu_ps(p, x);
  }
}

// The three float-output conversions: a scalar head up to 32-byte alignment
// when streaming, 8 elements per step, a scalar tail.
template <bool kStream>
GF_TF_SIMD void F32ScaleSimd(const float* src, float* dst, int64_t n, float scale) {
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = kStream ? HeadToAlign(dst, 4, n) : 0;
  F32ScaleScalar(src, dst, i, scale);
  for (; i + 8 <= n; i += 8) {
    StoreF32<kStream>(dst + i, _mm256_mul_ps(_mm256_loadu_ps(src + i), s));
  }
  F32ScaleScalar(src + i, dst + i, n - i, scale);
}

template <bool kStream>
GF_TF_SIMD void HalfToF32Simd(const uint16_t* src, float* dst, int64_t n, float scale) {
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = kStream ? HeadToAlign(dst, 4, n) : 0;
  HalfToF32Scalar(src, dst, i, scale);
  for (; i + 8 <= n; i += 8) {
    __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    StoreF32<kStream>(dst + i, _mm256_mul_ps(x, s));
  }
  HalfToF32Scalar(src + i, dst + i, n - i, scale);
}

template <bool kStream>
GF_TF_SIMD void Bf16ToF32Simd(const uint16_t* src, float* dst, int64_t n, float scale) {
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = kStream ? HeadToAlign(dst, 4, n) : 0;
  Bf16ToF32Scalar(src, dst, i, scale);
  for (; i + 8 <= n; i += 8) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    StoreF32<kStream>(dst + i, _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(w, 16)), s));
  }
  Bf16ToF32Scalar(src + i, dst + i, n - i, scale);
}

// MaxMaskedScalar for 32-bit and 16-bit lanes: two accumulators of 8 x 32
// or 16 x 16 bits, then the lanes and the scalar tail.
GF_TF_SIMD uint32_t MaxMasked32Simd(const uint32_t* src, int64_t n, uint32_t mask) {
  const __m256i k = _mm256_set1_epi32(static_cast<int>(mask));
  __m256i m0 = _mm256_setzero_si256(), m1 = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const auto* p = reinterpret_cast<const __m256i*>(src + i);
    m0 = _mm256_max_epu32(m0, _mm256_and_si256(_mm256_loadu_si256(p), k));
    m1 = _mm256_max_epu32(m1, _mm256_and_si256(_mm256_loadu_si256(p + 1), k));
  }
  alignas(32) uint32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_max_epu32(m0, m1));
  uint32_t m = MaxMaskedScalar(src + i, n - i, mask);
  for (uint32_t lane : lanes) m = std::max(m, lane);
  return m;
}

GF_TF_SIMD uint16_t MaxMasked16Simd(const uint16_t* src, int64_t n, uint16_t mask) {
  const __m256i k = _mm256_set1_epi16(static_cast<int16_t>(mask));
  __m256i m0 = _mm256_setzero_si256(), m1 = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const auto* p = reinterpret_cast<const __m256i*>(src + i);
    m0 = _mm256_max_epu16(m0, _mm256_and_si256(_mm256_loadu_si256(p), k));
    m1 = _mm256_max_epu16(m1, _mm256_and_si256(_mm256_loadu_si256(p + 1), k));
  }
  alignas(32) uint16_t lanes[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_max_epu16(m0, m1));
  uint16_t m = MaxMaskedScalar<uint16_t>(src + i, n - i, mask);
  for (uint16_t lane : lanes) m = std::max(m, lane);
  return m;
}

GF_TF_SIMD void ZeroStreamSimd(char* dst, int64_t bytes) {
  const int64_t head = HeadToAlign(dst, 1, bytes);
  std::memset(dst, 0, head);
  int64_t i = head;
  for (; i + 32 <= bytes; i += 32) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), _mm256_setzero_si256());
  }
  std::memset(dst + i, 0, bytes - i);
}

GF_TF_SIMD void CopyStreamSimd(char* dst, const char* src, int64_t bytes) {
  const int64_t head = HeadToAlign(dst, 1, bytes);
  std::memcpy(dst, src, head);
  int64_t i = head;
  for (; i + 32 <= bytes; i += 32) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
  }
  std::memcpy(dst + i, src + i, bytes - i);
}

template <bool kStream>
GF_TF_SIMD double AccumulateF32Simd(const float* r, const float* g,
                                    const float* v, float* v_out,
                                    float momentum, float* acc, int64_t n,
                                    double* lookahead) {
  const __m256 m = _mm256_set1_ps(momentum);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  double l1 = 0.0, ahead = 0.0;
  int64_t i = 0;
  while (i + 8 <= n) {
    // Sum |acc| (and |acc + momentum * u|) in float lanes over at most 1024
    // elements, then in double.
    const int64_t stop = std::min(n, i + 1024);
    __m256 lanes = _mm256_setzero_ps();
    __m256 ahead_lanes = _mm256_setzero_ps();
    for (; i + 8 <= stop; i += 8) {
      __m256 u = _mm256_loadu_ps(g + i);
      if (v != nullptr) {
        u = _mm256_add_ps(_mm256_mul_ps(m, _mm256_loadu_ps(v + i)), u);
        StoreF32<kStream>(v_out + i, u);
      }
      __m256 a = _mm256_add_ps(_mm256_loadu_ps(r + i), u);
      StoreF32<kStream>(acc + i, a);
      lanes = _mm256_add_ps(lanes, _mm256_and_ps(a, abs_mask));
      if (lookahead != nullptr) {
        const __m256 next = _mm256_add_ps(a, _mm256_mul_ps(m, u));
        ahead_lanes = _mm256_add_ps(ahead_lanes, _mm256_and_ps(next, abs_mask));
      }
    }
    alignas(32) float part[8];
    _mm256_store_ps(part, lanes);
    for (float p : part) l1 += p;
    if (lookahead != nullptr) {
      _mm256_store_ps(part, ahead_lanes);
      for (float p : part) ahead += p;
    }
  }
  if (lookahead != nullptr) *lookahead += ahead;
  return l1 + AccumulateF32Scalar(r + i, g + i, v == nullptr ? nullptr : v + i,
                                  v_out == nullptr ? nullptr : v_out + i,
                                  momentum, acc + i, n - i, lookahead);
}

// Streams acc (and v_out, when it has the same alignment) after a scalar head.
GF_TF_SIMD double AccumulateF32SimdDispatch(const float* r, const float* g,
                                            const float* v, float* v_out,
                                            float momentum, float* acc, int64_t n,
                                            bool stream, double* lookahead) {
  const int64_t head = stream ? HeadToAlign(acc, 4, n) : 0;
  if (!stream || (v_out != nullptr && HeadToAlign(v_out, 4, n) != head)) {
    return AccumulateF32Simd<false>(r, g, v, v_out, momentum, acc, n, lookahead);
  }
  const double l1 = AccumulateF32Scalar(r, g, v, v_out, momentum, acc, head, lookahead);
  return l1 + AccumulateF32Simd<true>(r + head, g + head, v ? v + head : nullptr,
                                      v_out ? v_out + head : nullptr, momentum,
                                      acc + head, n - head, lookahead);
}
#endif  // GF_TF_X86

bool UseSimd(bool requested) { return requested && CpuHasSimd(); }

void F32ToHalf(const float* s, uint16_t* d, int64_t n, float k, bool simd) {
#ifdef GF_TF_X86
  if (UseSimd(simd)) return F32ToHalfSimd(s, d, n, k);
#endif
  F32ToHalfScalar(s, d, n, k);
}
void F32ToBf16(const float* s, uint16_t* d, int64_t n, float k, bool simd) {
#ifdef GF_TF_X86
  if (UseSimd(simd)) return F32ToBf16Simd(s, d, n, k);
#endif
  F32ToBf16Scalar(s, d, n, k);
}
void F32Scale(const float* s, float* d, int64_t n, float k, bool simd,
              bool stream = false) {
  if (k == 1.0f) {
    if (s != d) CopyBytes(d, s, n * sizeof(float), stream && UseSimd(simd));
    return;
  }
#ifdef GF_TF_X86
  if (UseSimd(simd)) return stream ? F32ScaleSimd<true>(s, d, n, k) : F32ScaleSimd<false>(s, d, n, k);
#endif
  F32ScaleScalar(s, d, n, k);
}
void HalfToF32(const uint16_t* s, float* d, int64_t n, float k, bool simd,
               bool stream = false) {
#ifdef GF_TF_X86
  if (UseSimd(simd)) return stream ? HalfToF32Simd<true>(s, d, n, k) : HalfToF32Simd<false>(s, d, n, k);
#endif
  HalfToF32Scalar(s, d, n, k);
}
void Bf16ToF32(const uint16_t* s, float* d, int64_t n, float k, bool simd,
               bool stream = false) {
#ifdef GF_TF_X86
  if (UseSimd(simd)) return stream ? Bf16ToF32Simd<true>(s, d, n, k) : Bf16ToF32Simd<false>(s, d, n, k);
#endif
  Bf16ToF32Scalar(s, d, n, k);
}

// float -> wire dtype, scaled.
void F32ToWire(const float* src, DataType wire, void* dst, int64_t n,
               float scale, bool simd) {
  switch (wire) {
    case DT_HALF:
      return F32ToHalf(src, static_cast<uint16_t*>(dst), n, scale, simd);
    case DT_BFLOAT16:
      return F32ToBf16(src, static_cast<uint16_t*>(dst), n, scale, simd);
    default:
      return F32Scale(src, static_cast<float*>(dst), n, scale, simd);
  }
}

// wire (or any 16/32-bit float) -> float, scaled.
void WireToF32(DataType wire, const void* src, float* dst, int64_t n,
               float scale, bool simd, bool stream = false) {
  switch (wire) {
    case DT_HALF:
      return HalfToF32(static_cast<const uint16_t*>(src), dst, n, scale, simd, stream);
    case DT_BFLOAT16:
      return Bf16ToF32(static_cast<const uint16_t*>(src), dst, n, scale, simd, stream);
    default:
      return F32Scale(static_cast<const float*>(src), dst, n, scale, simd, stream);
  }
}

uint16_t MaxMasked16(const void* src, int64_t n, uint16_t mask, bool simd) {
  const auto* p = static_cast<const uint16_t*>(src);
#ifdef GF_TF_X86
  if (UseSimd(simd)) return MaxMasked16Simd(p, n, mask);
#endif
  return MaxMaskedScalar<uint16_t>(p, n, mask);
}

}  // namespace

float AbsMax(DataType src_dtype, const void* src, int64_t n, bool simd) {
  switch (src_dtype) {
    case DT_HALF:
      return HalfBitsToFloat(MaxMasked16(src, n, 0x7fffu, simd));
    case DT_BFLOAT16:
      return Bf16BitsToFloat(MaxMasked16(src, n, 0x7fffu, simd));
    case DT_DOUBLE: {  // no unsigned 64-bit max in AVX2: scalar
      const uint64_t bits = MaxMaskedScalar<uint64_t>(static_cast<const uint64_t*>(src), n,
                                                      0x7fffffffffffffffull);
      double d;
      std::memcpy(&d, &bits, 8);
      return static_cast<float>(d);
    }
    default: {
      const auto* p = static_cast<const uint32_t*>(src);
#ifdef GF_TF_X86
      if (UseSimd(simd)) return BitsFloat(MaxMasked32Simd(p, n, 0x7fffffffu));
#endif
      return BitsFloat(MaxMaskedScalar<uint32_t>(p, n, 0x7fffffffu));
    }
  }
}

tensorflow::Status Scales::Init(const char* op, const tensorflow::Tensor& t,
                                int64_t count, const char* items) {
  const bool scalar = t.dims() == 0;
  if (!scalar && !(t.dims() == 1 && t.dim_size(0) == count)) {
    return tensorflow::errors::InvalidArgument(
        op, ": scale must have shape [] or [", count, "] (", items, "), got ",
        t.shape().DebugString());
  }
  data_ = t.flat<float>().data();
  per_item_ = !scalar;
  return tensorflow::Status();
}

tensorflow::Status CheckScaleShape(tensorflow::shape_inference::InferenceContext* c,
                                   const char* op, int input,
                                   tensorflow::shape_inference::DimensionHandle count,
                                   const char* items) {
  const tensorflow::shape_inference::ShapeHandle s = c->input(input);
  if (!c->RankKnown(s) || c->Rank(s) == 0) return tensorflow::Status();
  if (c->Rank(s) == 1) {
    const auto d = c->Dim(s, 0);
    if (!c->ValueKnown(d) || !c->ValueKnown(count) || c->Value(d) == c->Value(count)) {
      return tensorflow::Status();
    }
  }
  const std::string expected = c->ValueKnown(count) ? std::to_string(c->Value(count)) : "?";
  return tensorflow::errors::InvalidArgument(op, ": scale must have shape [] or [", expected,
                                             "] (", items, "), got ", c->DebugString(s));
}

bool StreamOutput(int64_t output_bytes) {
  constexpr int64_t kStreamBytes = 16 << 20;  // well beyond L2, a good part of L3
  return output_bytes >= kStreamBytes && CpuHasSimd();
}

void ZeroBytes(void* dst, int64_t bytes, bool stream) {
#ifdef GF_TF_X86
  if (stream && CpuHasSimd()) return ZeroStreamSimd(static_cast<char*>(dst), bytes);
#endif
  std::memset(dst, 0, bytes);
}

void CopyBytes(void* dst, const void* src, int64_t bytes, bool stream) {
#ifdef GF_TF_X86
  if (stream && CpuHasSimd()) {
    return CopyStreamSimd(static_cast<char*>(dst), static_cast<const char*>(src), bytes);
  }
#endif
  std::memcpy(dst, src, bytes);
}

bool CpuHasSimd() {
#ifdef GF_TF_X86
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  }();
  return has;
#else
  return false;
#endif
}

void ToWire(DataType src_dtype, const void* src, DataType wire, void* dst,
            int64_t n, float scale, bool simd) {
  const int wire_bytes = tensorflow::DataTypeSize(wire);
  auto* out = static_cast<char*>(dst);
  if (src_dtype == DT_FLOAT) {
    return F32ToWire(static_cast<const float*>(src), wire, dst, n, scale, simd);
  }
  float tmp[kBlock];
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t len = std::min(kBlock, n - b);
    if (src_dtype == DT_DOUBLE) {
      const double* d = static_cast<const double*>(src) + b;
      const double k = scale;
      if (wire == DT_FLOAT) {
        for (int64_t i = 0; i < len; ++i) tmp[i] = static_cast<float>(d[i] * k);
      } else {
        for (int64_t i = 0; i < len; ++i) tmp[i] = DoubleToFloatRoundToOdd(d[i] * k);
      }
      F32ToWire(tmp, wire, out + b * wire_bytes, len, 1.0f, simd);
    } else {  // half or bfloat16: widening to float is exact.
      WireToF32(src_dtype, static_cast<const uint16_t*>(src) + b, tmp, len, 1.0f, simd);
      F32ToWire(tmp, wire, out + b * wire_bytes, len, scale, simd);
    }
  }
}

void FromWire(DataType wire, const void* src, DataType out_dtype, void* dst,
              int64_t n, float scale, bool simd, bool stream) {
  if (out_dtype == DT_FLOAT) {
    return WireToF32(wire, src, static_cast<float*>(dst), n, scale, simd, stream);
  }
  const int wire_bytes = tensorflow::DataTypeSize(wire);
  const int out_bytes = tensorflow::DataTypeSize(out_dtype);
  float tmp[kBlock];
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t len = std::min(kBlock, n - b);
    WireToF32(wire, static_cast<const char*>(src) + b * wire_bytes, tmp, len, scale, simd);
    void* out = static_cast<char*>(dst) + b * out_bytes;
    if (out_dtype == DT_DOUBLE) {
      double* d = static_cast<double*>(out);
      for (int64_t i = 0; i < len; ++i) d[i] = tmp[i];
    } else {
      F32ToWire(tmp, out_dtype, out, len, 1.0f, simd);
    }
  }
}

double AccumulateSegment(const float* residual, DataType grad_dtype,
                         const void* grad, const float* velocity,
                         float* velocity_out, float momentum, float* acc,
                         int64_t n, bool simd, bool stream, double* lookahead) {
  auto run = [&](const float* r, const float* g, const float* v, float* vo,
                 float* a, int64_t len) {
#ifdef GF_TF_X86
    if (UseSimd(simd)) {
      return AccumulateF32SimdDispatch(r, g, v, vo, momentum, a, len, stream, lookahead);
    }
#endif
    return AccumulateF32Scalar(r, g, v, vo, momentum, a, len, lookahead);
  };
  if (grad_dtype == DT_FLOAT) {
    return run(residual, static_cast<const float*>(grad), velocity, velocity_out,
               acc, n);
  }
  const int grad_bytes = tensorflow::DataTypeSize(grad_dtype);
  float tmp[kBlock];
  double l1 = 0.0;
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t len = std::min(kBlock, n - b);
    ToWire(grad_dtype, static_cast<const char*>(grad) + b * grad_bytes, DT_FLOAT,
           tmp, len, 1.0f, simd);
    l1 += run(residual + b, tmp, velocity == nullptr ? nullptr : velocity + b,
              velocity_out == nullptr ? nullptr : velocity_out + b, acc + b, len);
  }
  return l1;
}

std::vector<int64_t> PrefixOffsets(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> offsets(sizes.size() + 1, 0);
  for (size_t i = 0; i < sizes.size(); ++i) offsets[i + 1] = offsets[i] + sizes[i];
  return offsets;
}

void ForEachSegment(
    const std::vector<int64_t>& offsets, int64_t begin, int64_t end,
    const std::function<void(int, int64_t, int64_t, int64_t)>& fn) {
  if (begin >= end) return;
  // The last tensor starting at or before `begin` (skips empty tensors).
  int i = static_cast<int>(
      std::upper_bound(offsets.begin(), offsets.end() - 1, begin) - offsets.begin()) - 1;
  for (int64_t pos = begin; pos < end; ++i) {
    const int64_t stop = std::min(end, offsets[i + 1]);
    if (stop > pos) {
      fn(i, pos - offsets[i], pos - begin, stop - pos);
      pos = stop;
    }
  }
}

void ParallelFor(tensorflow::OpKernelContext* ctx, int64_t total,
                 int64_t cost_per_unit,
                 const std::function<void(int64_t, int64_t)>& work) {
  if (total <= 0) return;
  auto* threads = ctx->device()->tensorflow_cpu_worker_threads();
  tensorflow::Shard(threads->num_threads, threads->workers, total, cost_per_unit,
                    [&work](int64_t begin, int64_t end) {
    work(begin, end);
#ifdef GF_TF_X86
    // Orders this shard's non-temporal stores (if any) before the op completes.
    _mm_sfence();
#endif
  });
}

tensorflow::Status ReadOutputShapes(tensorflow::OpKernelConstruction* ctx,
                                    const char* op, size_t num_outputs,
                                    std::vector<tensorflow::TensorShape>* shapes,
                                    std::vector<int64_t>* offsets) {
  std::vector<tensorflow::PartialTensorShape> partial;
  TF_RETURN_IF_ERROR(ctx->GetAttr("shapes", &partial));
  if (partial.size() != num_outputs) {
    return tensorflow::errors::InvalidArgument(op, ": ", partial.size(), " shapes but ",
                                               num_outputs, " output dtypes (Tout)");
  }
  std::vector<int64_t> sizes;
  for (size_t i = 0; i < partial.size(); ++i) {
    tensorflow::TensorShape full;
    if (!partial[i].AsTensorShape(&full)) {
      return tensorflow::errors::InvalidArgument(
          op, ": shapes[", i, "] = ", partial[i].DebugString(),
          " is not fully defined; unpacking needs static shapes");
    }
    shapes->push_back(full);
    sizes.push_back(full.num_elements());
  }
  *offsets = PrefixOffsets(sizes);
  return tensorflow::Status();
}

tensorflow::Status AllocateTensorsOutput(
    tensorflow::OpKernelContext* ctx,
    const std::vector<tensorflow::TensorShape>& shapes, std::vector<char*>* data) {
  tensorflow::OpOutputList outputs;
  TF_RETURN_IF_ERROR(ctx->output_list("tensors", &outputs));
  data->resize(shapes.size());
  for (size_t i = 0; i < shapes.size(); ++i) {
    tensorflow::Tensor* t = nullptr;
    TF_RETURN_IF_ERROR(outputs.allocate(i, shapes[i], &t));
    (*data)[i] = static_cast<char*>(t->data());
  }
  return tensorflow::Status();
}

}  // namespace gf_tf
