// GfPack / GfUnpack: many gradients <-> one wire buffer (FP16, BF16 or FP32),
// scaled (one scale per tensor, or one for all) and cast in the same single
// pass over the bytes; GfAbsMax: the per-tensor magnitude bound the scales
// are chosen from.
// Source: GradientFlow (arXiv 1902.06855), lazy all-reduce and
// mixed-precision communication.
#include <atomic>
#include <cstring>
#include <memory>
#include <vector>

#include "gf_kernels.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor_shape.h"

namespace gf_tf {

using tensorflow::DataTypeVector;
using tensorflow::OpInputList;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::PartialTensorShape;
using tensorflow::Status;
using tensorflow::Tensor;
using tensorflow::TensorShape;
using tensorflow::errors::InvalidArgument;
namespace shape_inference = tensorflow::shape_inference;

// Packed elements per unit of parallel work.
constexpr int64_t kPackBlock = 32 * 1024;

// What a vector `scale` holds, for error messages.
constexpr char kPerInputTensor[] = "one scale per input tensor";
constexpr char kPerOutputTensor[] = "one scale per output tensor";

REGISTER_OP("GfPack")
    .Input("tensors: Tin")
    .Input("scale: float")
    .Output("packed: wire_dtype")
    .Attr("Tin: list(" GF_TF_GRAD_TYPES ") >= 0")
    .Attr("wire_dtype: " GF_TF_WIRE_TYPES)
    .Attr("simd: bool = true")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      const int num_tensors = c->num_inputs() - 1;
      TF_RETURN_IF_ERROR(CheckScaleShape(c, "GfPack", num_tensors, c->MakeDim(num_tensors),
                                         kPerInputTensor));
      shape_inference::DimensionHandle total = c->MakeDim(0);
      for (int i = 0; i < num_tensors; ++i) {
        TF_RETURN_IF_ERROR(c->Add(total, c->NumElements(c->input(i)), &total));
      }
      c->set_output(0, c->Vector(total));
      return Status();
    })
    .Doc(R"doc(
Flattens the tensors, multiplies each element of tensors[i] by scale[i] (or
by `scale` when it is a scalar) and casts it to `wire_dtype` (round to nearest
even, overflow to +-inf, NaN stays NaN), all into one 1-D buffer in list
order. The product is formed in float32 (in float64 for float64 inputs, which
are then rounded once). scale: float32, shape [] or [len(tensors)].
`simd=false` forces the scalar code.
)doc");

class GfPackOp : public OpKernel {
 public:
  explicit GfPackOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("wire_dtype", &wire_dtype_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("simd", &simd_));
  }

  void Compute(OpKernelContext* ctx) override {
    OpInputList tensors;
    OP_REQUIRES_OK(ctx, ctx->input_list("tensors", &tensors));
    const Tensor* scale_input = nullptr;
    OP_REQUIRES_OK(ctx, ctx->input("scale", &scale_input));
    Scales scale;
    OP_REQUIRES_OK(ctx, scale.Init("GfPack", *scale_input, tensors.size(), kPerInputTensor));
    std::vector<int64_t> sizes;
    for (const Tensor& t : tensors) sizes.push_back(t.NumElements());
    const std::vector<int64_t> offsets = PrefixOffsets(sizes);
    const int64_t total = offsets.back();

    Tensor* packed = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({total}), &packed));
    char* out = static_cast<char*>(packed->data());
    const int wire_bytes = tensorflow::DataTypeSize(wire_dtype_);

    ParallelFor(ctx, (total + kPackBlock - 1) / kPackBlock, 2 * kPackBlock,
                [&](int64_t first, int64_t last) {
      const int64_t begin = first * kPackBlock;
      const int64_t end = std::min(total, last * kPackBlock);
      ForEachSegment(offsets, begin, end,
                     [&](int i, int64_t in_tensor, int64_t, int64_t len) {
        const Tensor& t = tensors[i];
        const char* src = static_cast<const char*>(t.data()) +
                          in_tensor * tensorflow::DataTypeSize(t.dtype());
        ToWire(t.dtype(), src, wire_dtype_,
               out + (offsets[i] + in_tensor) * wire_bytes, len, scale[i], simd_);
      });
    });
  }

 private:
  tensorflow::DataType wire_dtype_;
  bool simd_;
};

REGISTER_KERNEL_BUILDER(Name("GfPack").Device(tensorflow::DEVICE_CPU), GfPackOp);

REGISTER_OP("GfUnpack")
    .Input("packed: wire_dtype")
    .Input("scale: float")
    .Output("tensors: Tout")
    .Attr("wire_dtype: " GF_TF_WIRE_TYPES)
    .Attr("Tout: list(" GF_TF_GRAD_TYPES ") >= 0")
    .Attr("shapes: list(shape) >= 0")
    .Attr("simd: bool = true")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      std::vector<PartialTensorShape> shapes;
      TF_RETURN_IF_ERROR(c->GetAttr("shapes", &shapes));
      if (static_cast<int>(shapes.size()) != c->num_outputs()) {
        return InvalidArgument("GfUnpack: ", shapes.size(), " shapes but ",
                               c->num_outputs(), " output dtypes (Tout)");
      }
      shape_inference::ShapeHandle vec;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &vec));
      TF_RETURN_IF_ERROR(CheckScaleShape(c, "GfUnpack", 1, c->MakeDim(c->num_outputs()),
                                         kPerOutputTensor));
      for (int i = 0; i < c->num_outputs(); ++i) {
        shape_inference::ShapeHandle s;
        TF_RETURN_IF_ERROR(c->MakeShapeFromPartialTensorShape(shapes[i], &s));
        c->set_output(i, s);
      }
      return Status();
    })
    .Doc(R"doc(
Inverse of GfPack: splits `packed` into tensors of `shapes`; output i is
cast(float32(segment i) * scale[i]) to its dtype in `Tout` (the product in
float32). scale: float32, shape [] (one for all) or [len(shapes)].
)doc");

class GfUnpackOp : public OpKernel {
 public:
  explicit GfUnpackOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("wire_dtype", &wire_dtype_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("Tout", &out_dtypes_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("simd", &simd_));
    OP_REQUIRES_OK(ctx, ReadOutputShapes(ctx, "GfUnpack", out_dtypes_.size(), &shapes_,
                                         &offsets_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& packed = ctx->input(0);
    const int64_t total = offsets_.back();
    OP_REQUIRES(ctx, packed.dims() == 1,
                InvalidArgument("GfUnpack: the packed buffer must be 1-D, got shape ",
                                packed.shape().DebugString()));
    OP_REQUIRES(ctx, packed.NumElements() == total,
                InvalidArgument("GfUnpack: the packed buffer has ", packed.NumElements(),
                                " elements but the shapes hold ", total,
                                "; they must match"));
    Scales scale;
    OP_REQUIRES_OK(ctx, scale.Init("GfUnpack", ctx->input(1), shapes_.size(), kPerOutputTensor));
    std::vector<char*> out_data;
    OP_REQUIRES_OK(ctx, AllocateTensorsOutput(ctx, shapes_, &out_data));
    const char* src = static_cast<const char*>(packed.data());
    const int wire_bytes = tensorflow::DataTypeSize(wire_dtype_);
    const bool stream = simd_ && StreamOutput(total * sizeof(float));
    ParallelFor(ctx, (total + kPackBlock - 1) / kPackBlock, 2 * kPackBlock,
                [&](int64_t first, int64_t last) {
      const int64_t begin = first * kPackBlock;
      const int64_t end = std::min(total, last * kPackBlock);
      ForEachSegment(offsets_, begin, end,
                     [&](int i, int64_t in_tensor, int64_t, int64_t len) {
        const int out_bytes = tensorflow::DataTypeSize(out_dtypes_[i]);
        FromWire(wire_dtype_, src + (offsets_[i] + in_tensor) * wire_bytes,
                 out_dtypes_[i], out_data[i] + in_tensor * out_bytes, len,
                 scale[i], simd_, stream);
      });
    });
  }

 private:
  tensorflow::DataType wire_dtype_;
  DataTypeVector out_dtypes_;
  std::vector<TensorShape> shapes_;
  std::vector<int64_t> offsets_;
  bool simd_;
};

REGISTER_KERNEL_BUILDER(Name("GfUnpack").Device(tensorflow::DEVICE_CPU), GfUnpackOp);

// ---------------------------------------------------------------------------

REGISTER_OP("GfAbsMax")
    .Input("tensors: Tin")
    .Output("abs_max: float")
    .Attr("Tin: list(" GF_TF_GRAD_TYPES ") >= 0")
    .Attr("simd: bool = true")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      c->set_output(0, c->Vector(c->num_inputs()));
      return Status();
    })
    .Doc(R"doc(
abs_max[i] = max |tensors[i]| as float32: 0 for an empty tensor, NaN if it
holds a NaN, else inf if it holds +-inf. Exact for half, bfloat16 and float
inputs; a float64 maximum is rounded to the nearest float32. The magnitude
bound from which a power-of-two wire scale is chosen.
)doc");

class GfAbsMaxOp : public OpKernel {
 public:
  explicit GfAbsMaxOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("simd", &simd_));
  }

  void Compute(OpKernelContext* ctx) override {
    OpInputList tensors;
    OP_REQUIRES_OK(ctx, ctx->input_list("tensors", &tensors));
    std::vector<int64_t> sizes;
    for (const Tensor& t : tensors) sizes.push_back(t.NumElements());
    const std::vector<int64_t> offsets = PrefixOffsets(sizes);
    const int64_t total = offsets.back();
    const int num_tensors = tensors.size();
    Tensor* abs_max = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({num_tensors}), &abs_max));

    // Shards combine their maxima per tensor through the bits of non-negative
    // floats (AbsMax's results), whose unsigned order is the order of values.
    std::unique_ptr<std::atomic<uint32_t>[]> bits(new std::atomic<uint32_t>[num_tensors]);
    for (int i = 0; i < num_tensors; ++i) bits[i].store(0);
    ParallelFor(ctx, (total + kPackBlock - 1) / kPackBlock, kPackBlock,
                [&](int64_t first, int64_t last) {
      const int64_t begin = first * kPackBlock;
      const int64_t end = std::min(total, last * kPackBlock);
      ForEachSegment(offsets, begin, end, [&](int i, int64_t in_tensor, int64_t, int64_t len) {
        const Tensor& t = tensors[i];
        const char* src = static_cast<const char*>(t.data()) +
                          in_tensor * tensorflow::DataTypeSize(t.dtype());
        const float m = AbsMax(t.dtype(), src, len, simd_);
        uint32_t m_bits;
        std::memcpy(&m_bits, &m, 4);
        uint32_t seen = bits[i].load();
        while (m_bits > seen && !bits[i].compare_exchange_weak(seen, m_bits)) {
        }
      });
    });
    float* out = abs_max->flat<float>().data();
    for (int i = 0; i < num_tensors; ++i) {
      const uint32_t b = bits[i].load();
      std::memcpy(out + i, &b, 4);
    }
  }

 private:
  bool simd_;
};

REGISTER_KERNEL_BUILDER(Name("GfAbsMax").Device(tensorflow::DEVICE_CPU), GfAbsMaxOp);

}  // namespace gf_tf

// Read by gf_tf/ops.py through ctypes (after TensorFlow loaded the library)
// to report which kernels run.
extern "C" int gf_tf_cpu_has_simd() { return gf_tf::CpuHasSimd() ? 1 : 0; }
