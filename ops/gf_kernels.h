// Shared pieces of the GradientFlow CPU kernels: dtype conversion with a
// scale factor (runtime-dispatched AVX2/F16C or portable scalar code), the
// walk over a packed range that spans several tensors, and sharding onto the
// device's thread pool.
#ifndef GF_TF_OPS_GF_KERNELS_H_
#define GF_TF_OPS_GF_KERNELS_H_

#include <algorithm>
#include <cstdint>
#include <functional>
#include <vector>

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/types.h"

namespace gf_tf {

using tensorflow::DataType;

// True if this CPU (and OS) supports AVX2 and F16C; checked once.
bool CpuHasSimd();

// dst[i] = wire(src[i] * scale) for i < n.
// src dtype: half, bfloat16, float or double; wire: half, bfloat16 or float.
// The product is formed in float (in double for double inputs, which are then
// rounded once, to the wire dtype). Rounding is to nearest even, values beyond
// the wire range become +-inf, NaN stays NaN.
void ToWire(DataType src_dtype, const void* src, DataType wire_dtype, void* dst,
            int64_t n, float scale, bool simd);

// dst[i] = out(float(src[i]) * scale) for i < n; out: half, bfloat16, float, double.
// `stream`: write float outputs with non-temporal stores (see StreamOutput).
void FromWire(DataType wire_dtype, const void* src, DataType out_dtype, void* dst,
              int64_t n, float scale, bool simd, bool stream = false);

// Whether an op writing `output_bytes` should bypass the cache with
// non-temporal stores: for outputs far larger than the caches this skips the
// read-for-ownership of every written line (up to ~2x faster writes); small
// outputs stay in cache for their consumer.
bool StreamOutput(int64_t output_bytes);

// memset(dst, 0, bytes) / memcpy(dst, src, bytes), optionally non-temporal.
void ZeroBytes(void* dst, int64_t bytes, bool stream);
void CopyBytes(void* dst, const void* src, int64_t bytes, bool stream);

// acc[i] = residual[i] + u[i], u[i] = momentum * velocity[i] + grad[i] when
// velocity is given (then velocity_out[i] = u[i]), else u[i] = grad[i].
// grad has dtype grad_dtype. In-place (acc == residual, velocity_out ==
// velocity) is allowed. Returns sum |acc[i]|. With `lookahead` (not null),
// also adds sum |acc[i] + momentum * u[i]| to *lookahead: the next step's
// accumulator as far as it is known now (the product rounded to float, then
// the sum, as TensorFlow's `acc + momentum * u`).
double AccumulateSegment(const float* residual, DataType grad_dtype,
                         const void* grad, const float* velocity,
                         float* velocity_out, float momentum, float* acc,
                         int64_t n, bool simd, bool stream = false,
                         double* lookahead = nullptr);

// Element offsets of a list of tensors laid end to end: offsets[i] is where
// tensor i starts, offsets.back() the total.
std::vector<int64_t> PrefixOffsets(const std::vector<int64_t>& sizes);

// Calls fn(tensor_index, offset_in_tensor, offset_in_range, length) for each
// maximal piece of the packed range [begin, end) lying in one tensor.
void ForEachSegment(
    const std::vector<int64_t>& offsets, int64_t begin, int64_t end,
    const std::function<void(int, int64_t, int64_t, int64_t)>& fn);

// Runs work(begin, end) over [0, total) on the device's CPU thread pool.
// cost_per_unit is a rough count of cycles per unit of work. Each shard ends
// with a store fence, which the non-temporal stores (`stream`) of the
// functions above rely on: call them only inside ParallelFor.
void ParallelFor(tensorflow::OpKernelContext* ctx, int64_t total,
                 int64_t cost_per_unit,
                 const std::function<void(int64_t, int64_t)>& work);

// Reads the "shapes" attr of an unpacking op (one fully defined shape per
// output dtype) into `shapes`, and the element offsets of those tensors laid
// end to end into `offsets` (see PrefixOffsets). `op` names the op in errors.
tensorflow::Status ReadOutputShapes(tensorflow::OpKernelConstruction* ctx,
                                    const char* op, size_t num_outputs,
                                    std::vector<tensorflow::TensorShape>* shapes,
                                    std::vector<int64_t>* offsets);

// Allocates the output list "tensors" with `shapes` and returns each output's
// data pointer in `data` (the unpacking ops write straight into them).
tensorflow::Status AllocateTensorsOutput(
    tensorflow::OpKernelContext* ctx,
    const std::vector<tensorflow::TensorShape>& shapes, std::vector<char*>* data);

// max |src[i]| over i < n as float32 (0 for n == 0); NaN if any src[i] is
// NaN, else inf if any is +-inf. src dtype: half, bfloat16, float or double
// (a double maximum is rounded to the nearest float). Computed on the bits
// with the sign cleared (exact, NaN above inf above every finite value); the
// result is never negative and a NaN result has its sign bit clear, so the
// bits of two results, as unsigned integers, order like their values.
float AbsMax(DataType src_dtype, const void* src, int64_t n, bool simd);

// The `scale` input of the scaling ops: one float32 for every item (shape [])
// or one per item (shape [count]); scale[i] is item i's.
class Scales {
 public:
  // Checks the shape of `t`; on error names `op`, the expected shapes and
  // `items` (what the count counts, e.g. "one per input tensor").
  tensorflow::Status Init(const char* op, const tensorflow::Tensor& t,
                          int64_t count, const char* items);
  float operator[](int64_t i) const { return per_item_ ? data_[i] : data_[0]; }

 private:
  const float* data_ = nullptr;
  bool per_item_ = false;
};

// Shape-function check of a `scale` input (input index `input`): rank 0, or
// rank 1 with `count` elements when both are known.
tensorflow::Status CheckScaleShape(tensorflow::shape_inference::InferenceContext* c,
                                   const char* op, int input,
                                   tensorflow::shape_inference::DimensionHandle count,
                                   const char* items);

// ceil(n / chunk_size) for n >= 0, chunk_size >= 1, without forming n + chunk_size
// (which overflows for a chunk_size near 2^63 and gave 0 chunks).
inline int64_t NumChunks(int64_t n, int64_t chunk_size) {
  return n <= 0 ? 0 : 1 + (n - 1) / chunk_size;
}

// Elements in one full chunk of a buffer of n: the cost of a chunk for ParallelFor
// (chunk_size itself can be near 2^63, and a multiple of it overflows).
inline int64_t ChunkLength(int64_t n, int64_t chunk_size) {
  return std::min(n, chunk_size);
}

// The wire, input and output dtype sets the ops accept (see REGISTER_OP).
#define GF_TF_WIRE_TYPES "{half, bfloat16, float}"
#define GF_TF_GRAD_TYPES "{half, bfloat16, float, double}"

}  // namespace gf_tf

#endif  // GF_TF_OPS_GF_KERNELS_H_
