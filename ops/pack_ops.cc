// GfPack / GfUnpack: many gradients <-> one wire buffer (FP16, BF16 or FP32),
// scaled and cast in the same single pass over the bytes.
// Source: GradientFlow (arXiv 1902.06855), lazy all-reduce and
// mixed-precision communication.
#include <vector>

#include "gf_kernels.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor_shape.h"

namespace gf_tf {

using tensorflow::DataTypeString;
using tensorflow::DataTypeVector;
using tensorflow::OpInputList;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::OpOutputList;
using tensorflow::PartialTensorShape;
using tensorflow::Status;
using tensorflow::Tensor;
using tensorflow::TensorShape;
using tensorflow::errors::InvalidArgument;
namespace shape_inference = tensorflow::shape_inference;

// Packed elements per unit of parallel work.
constexpr int64_t kPackBlock = 32 * 1024;

REGISTER_OP("GfPack")
    .Input("tensors: Tin")
    .Output("packed: wire_dtype")
    .Attr("Tin: list(" GF_TF_GRAD_TYPES ") >= 0")
    .Attr("wire_dtype: " GF_TF_WIRE_TYPES)
    .Attr("scale: float = 1.0")
    .Attr("simd: bool = true")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::DimensionHandle total = c->MakeDim(0);
      for (int i = 0; i < c->num_inputs(); ++i) {
        TF_RETURN_IF_ERROR(c->Add(total, c->NumElements(c->input(i)), &total));
      }
      c->set_output(0, c->Vector(total));
      return Status();
    })
    .Doc(R"doc(
Flattens the tensors, multiplies each element by `scale` and casts it to
`wire_dtype` (round to nearest even, overflow to +-inf, NaN stays NaN), all
into one 1-D buffer in list order. `simd=false` forces the scalar code.
)doc");

class GfPackOp : public OpKernel {
 public:
  explicit GfPackOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("wire_dtype", &wire_dtype_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("scale", &scale_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("simd", &simd_));
  }

  void Compute(OpKernelContext* ctx) override {
    OpInputList tensors;
    OP_REQUIRES_OK(ctx, ctx->input_list("tensors", &tensors));
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
               out + (offsets[i] + in_tensor) * wire_bytes, len, scale_, simd_);
      });
    });
  }

 private:
  tensorflow::DataType wire_dtype_;
  float scale_;
  bool simd_;
};

REGISTER_KERNEL_BUILDER(Name("GfPack").Device(tensorflow::DEVICE_CPU), GfPackOp);

REGISTER_OP("GfUnpack")
    .Input("packed: wire_dtype")
    .Output("tensors: Tout")
    .Attr("wire_dtype: " GF_TF_WIRE_TYPES)
    .Attr("Tout: list(" GF_TF_GRAD_TYPES ") >= 0")
    .Attr("shapes: list(shape) >= 0")
    .Attr("scale: float = 1.0")
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
      for (int i = 0; i < c->num_outputs(); ++i) {
        shape_inference::ShapeHandle s;
        TF_RETURN_IF_ERROR(c->MakeShapeFromPartialTensorShape(shapes[i], &s));
        c->set_output(i, s);
      }
      return Status();
    })
    .Doc(R"doc(
Inverse of GfPack: splits `packed` into tensors of `shapes`, each element
multiplied by `scale` in float and cast to its dtype in `Tout`.
)doc");

class GfUnpackOp : public OpKernel {
 public:
  explicit GfUnpackOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("wire_dtype", &wire_dtype_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("Tout", &out_dtypes_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("scale", &scale_));
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
                 scale_, simd_, stream);
      });
    });
  }

 private:
  tensorflow::DataType wire_dtype_;
  DataTypeVector out_dtypes_;
  std::vector<TensorShape> shapes_;
  std::vector<int64_t> offsets_;
  float scale_;
  bool simd_;
};

REGISTER_KERNEL_BUILDER(Name("GfUnpack").Device(tensorflow::DEVICE_CPU), GfUnpackOp);

}  // namespace gf_tf

// Read by gf_tf/ops.py through ctypes (after TensorFlow loaded the library)
// to report which kernels run.
extern "C" int gf_tf_cpu_has_simd() { return gf_tf::CpuHasSimd() ? 1 : 0; }
