// Chunk ops of coarse-grained sparse communication (CSC): error-feedback
// accumulation with per-chunk L1 norms, gather of the selected chunks into a
// dense wire buffer (zeroing them in the residual), and scatter back into
// unpacked gradients. A chunk is `chunk_size` consecutive elements of the
// packed buffer; the last one may be partial.
// Source: GradientFlow (arXiv 1902.06855), coarse-grained sparse communication.
#include <cstring>
#include <limits>
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

namespace {

Status CheckChunkSize(const char* op, int64_t chunk_size) {
  if (chunk_size < 1) {
    return InvalidArgument(op, ": chunk_size must be >= 1 element, got ", chunk_size);
  }
  return Status();
}

// Chunk indices are int32 on the wire of the norms all-reduce and top-k.
Status CheckNumChunks(const char* op, int64_t n, int64_t chunk_size) {
  if (NumChunks(n, chunk_size) > std::numeric_limits<int32_t>::max()) {
    return InvalidArgument(op, ": ", n, " elements in chunks of ", chunk_size,
                           " give more than 2^31 - 1 chunks; use a larger chunk_size");
  }
  return Status();
}

Status CheckFlatFloat(const char* op, const char* name, const Tensor& t) {
  if (t.dims() != 1) {
    return InvalidArgument(op, ": ", name, " must be 1-D float32, got shape ",
                           t.shape().DebugString());
  }
  return Status();
}

// Validates `indices` (sorted ascending, unique, in [0, num_chunks)) and
// returns rank[c] = position of chunk c in `indices` or -1, and the number of
// elements the chunks cover.
template <typename Index>
Status ChunkRanks(const char* op, const Tensor& indices_t, int64_t n,
                  int64_t chunk_size, std::vector<int64_t>* rank,
                  int64_t* covered) {
  if (indices_t.dims() != 1) {
    return InvalidArgument(op, ": indices must be 1-D, got shape ",
                           indices_t.shape().DebugString());
  }
  const int64_t num_chunks = NumChunks(n, chunk_size);
  const auto indices = indices_t.flat<Index>();
  rank->assign(num_chunks, -1);
  *covered = 0;
  for (int64_t j = 0; j < indices.size(); ++j) {
    const int64_t c = indices(j);
    if (c < 0 || c >= num_chunks) {
      return InvalidArgument(op, ": indices[", j, "] = ", c, " is out of range [0, ",
                             num_chunks, ") for ", n, " elements in chunks of ",
                             chunk_size);
    }
    if (j > 0 && c <= indices(j - 1)) {
      return InvalidArgument(op, ": indices must be sorted ascending without duplicates, but indices[",
                             j, "] = ", c, " follows indices[", j - 1, "] = ",
                             indices(j - 1));
    }
    (*rank)[c] = j;
    *covered += std::min(chunk_size, n - c * chunk_size);
  }
  return Status();
}

Status ChunkRanks(const char* op, const Tensor& indices, int64_t n,
                  int64_t chunk_size, std::vector<int64_t>* rank,
                  int64_t* covered) {
  if (indices.dtype() == tensorflow::DT_INT64) {
    return ChunkRanks<int64_t>(op, indices, n, chunk_size, rank, covered);
  }
  return ChunkRanks<int32_t>(op, indices, n, chunk_size, rank, covered);
}

// What a vector `scale` of the chunk ops holds, for error messages.
constexpr char kPerSelectedChunk[] = "one scale per selected chunk, k = len(indices)";

// The k of a `scale` input: the length of `indices` (input `indices_input`),
// unknown if its shape is.
shape_inference::DimensionHandle NumIndices(shape_inference::InferenceContext* c,
                                            int indices_input) {
  const shape_inference::ShapeHandle s = c->input(indices_input);
  return c->RankKnown(s) && c->Rank(s) == 1 ? c->Dim(s, 0) : c->UnknownDim();
}

Status SameShapeAsInput0(shape_inference::InferenceContext* c, int output) {
  shape_inference::ShapeHandle vec;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &vec));
  c->set_output(output, vec);
  return Status();
}

}  // namespace

// ---------------------------------------------------------------------------

REGISTER_OP("GfAccumulate")
    .Input("residual: float")
    .Input("tensors: Tin")
    .Input("velocity: num_velocity * float")
    .Output("acc: float")
    .Output("norms: float")
    .Output("new_velocity: num_velocity * float")
    .Output("lookahead: float")
    .Attr("Tin: list(" GF_TF_GRAD_TYPES ") >= 0")
    .Attr("num_velocity: int >= 0")
    .Attr("chunk_size: int")
    .Attr("momentum: float = 0.0")
    .Attr("with_lookahead: bool = false")
    .Attr("simd: bool = true")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      int64_t chunk_size;
      TF_RETURN_IF_ERROR(c->GetAttr("chunk_size", &chunk_size));
      TF_RETURN_IF_ERROR(CheckChunkSize("GfAccumulate", chunk_size));
      TF_RETURN_IF_ERROR(SameShapeAsInput0(c, 0));
      shape_inference::DimensionHandle n = c->Dim(c->input(0), 0);
      shape_inference::DimensionHandle chunks = c->UnknownDim();
      if (c->ValueKnown(n)) chunks = c->MakeDim(NumChunks(c->Value(n), chunk_size));
      c->set_output(1, c->Vector(chunks));
      const int lookahead = c->num_outputs() - 1;
      for (int i = 2; i < lookahead; ++i) TF_RETURN_IF_ERROR(SameShapeAsInput0(c, i));
      bool with_lookahead;
      TF_RETURN_IF_ERROR(c->GetAttr("with_lookahead", &with_lookahead));
      c->set_output(lookahead, c->Vector(with_lookahead ? chunks : c->MakeDim(0)));
      return Status();
    })
    .Doc(R"doc(
u = pack(tensors) (+ momentum * velocity, then new_velocity = u);
acc = residual + u; norms[c] = sum |acc| over chunk c. One pass.
With with_lookahead (needs a velocity): lookahead[c] = sum |acc + momentum * u|
over chunk c, else lookahead is empty.
)doc");

class GfAccumulateOp : public OpKernel {
 public:
  explicit GfAccumulateOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("chunk_size", &chunk_size_));
    OP_REQUIRES_OK(ctx, CheckChunkSize("accumulate", chunk_size_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("momentum", &momentum_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("simd", &simd_));
    int num_velocity;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_velocity", &num_velocity));
    OP_REQUIRES(ctx, num_velocity <= 1,
                InvalidArgument("accumulate: at most one velocity, got ", num_velocity));
    has_velocity_ = num_velocity == 1;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("with_lookahead", &with_lookahead_));
    OP_REQUIRES(ctx, !with_lookahead_ || has_velocity_,
                InvalidArgument("accumulate: lookahead needs a velocity"));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& residual = ctx->input(0);
    OP_REQUIRES_OK(ctx, CheckFlatFloat("accumulate", "residual", residual));
    const int64_t n = residual.NumElements();
    OpInputList tensors;
    OP_REQUIRES_OK(ctx, ctx->input_list("tensors", &tensors));
    std::vector<int64_t> sizes;
    for (const Tensor& t : tensors) sizes.push_back(t.NumElements());
    const std::vector<int64_t> offsets = PrefixOffsets(sizes);
    OP_REQUIRES(ctx, offsets.back() == n,
                InvalidArgument("accumulate: the tensors hold ", offsets.back(),
                                " elements in total but residual has ", n,
                                "; they must match"));
    OP_REQUIRES_OK(ctx, CheckNumChunks("accumulate", n, chunk_size_));
    const int velocity_index = 1 + tensors.size();
    if (has_velocity_) {
      const Tensor& v = ctx->input(velocity_index);
      OP_REQUIRES(ctx, v.shape() == residual.shape(),
                  InvalidArgument("accumulate: velocity has shape ", v.shape().DebugString(),
                                  " but residual has ", residual.shape().DebugString()));
    }

    // Updating in place when TensorFlow lets us (the input has no other user)
    // spares a fresh buffer and its page faults.
    Tensor* acc = nullptr;
    OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({0}, 0, residual.shape(), &acc));
    Tensor* norms = nullptr;
    const int64_t num_chunks = NumChunks(n, chunk_size_);
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({num_chunks}), &norms));
    Tensor* lookahead = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
                            "lookahead", TensorShape({with_lookahead_ ? num_chunks : 0}),
                            &lookahead));
    float* ahead = with_lookahead_ ? lookahead->flat<float>().data() : nullptr;
    const float* velocity = nullptr;
    float* velocity_out = nullptr;
    if (has_velocity_) {
      Tensor* v_out = nullptr;
      OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output(
                              {velocity_index}, 2, residual.shape(), &v_out));
      velocity = ctx->input(velocity_index).flat<float>().data();
      velocity_out = v_out->flat<float>().data();
    }
    const float* r = residual.flat<float>().data();
    float* a = acc->flat<float>().data();
    float* norm = norms->flat<float>().data();
    // A fresh acc is written without reading it first; in place, it was just read.
    const bool stream = simd_ && a != r && StreamOutput(n * sizeof(float));

    ParallelFor(ctx, num_chunks, 4 * ChunkLength(n, chunk_size_), [&](int64_t first, int64_t last) {
      for (int64_t c = first; c < last; ++c) {
        const int64_t begin = c * chunk_size_;
        const int64_t end = std::min(n, begin + chunk_size_);
        double l1 = 0.0, ahead_l1 = 0.0;
        ForEachSegment(offsets, begin, end,
                       [&](int i, int64_t in_tensor, int64_t, int64_t len) {
          const Tensor& t = tensors[i];
          const int64_t pos = offsets[i] + in_tensor;
          const char* g = static_cast<const char*>(t.data()) +
                          in_tensor * tensorflow::DataTypeSize(t.dtype());
          l1 += AccumulateSegment(r + pos, t.dtype(), g,
                                  velocity ? velocity + pos : nullptr,
                                  velocity_out ? velocity_out + pos : nullptr,
                                  momentum_, a + pos, len, simd_, stream,
                                  ahead != nullptr ? &ahead_l1 : nullptr);
        });
        norm[c] = static_cast<float>(l1);
        if (ahead != nullptr) ahead[c] = static_cast<float>(ahead_l1);
      }
    });
  }

 private:
  int64_t chunk_size_;
  float momentum_;
  bool simd_;
  bool has_velocity_;
  bool with_lookahead_;
};

REGISTER_KERNEL_BUILDER(Name("GfAccumulate").Device(tensorflow::DEVICE_CPU), GfAccumulateOp);

// ---------------------------------------------------------------------------

REGISTER_OP("GfGatherChunks")
    .Input("acc: float")
    .Input("indices: Tindices")
    .Input("scale: float")
    .Input("velocity: num_velocity * float")
    .Output("selected: wire_dtype")
    .Output("residual: float")
    .Output("new_velocity: num_velocity * float")
    .Attr("Tindices: {int32, int64}")
    .Attr("num_velocity: int >= 0")
    .Attr("chunk_size: int")
    .Attr("wire_dtype: " GF_TF_WIRE_TYPES)
    .Attr("simd: bool = true")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      TF_RETURN_IF_ERROR(CheckScaleShape(c, "GfGatherChunks", 2, NumIndices(c, 1),
                                         kPerSelectedChunk));
      c->set_output(0, c->Vector(c->UnknownDim()));
      TF_RETURN_IF_ERROR(SameShapeAsInput0(c, 1));
      for (int i = 2; i < c->num_outputs(); ++i) TF_RETURN_IF_ERROR(SameShapeAsInput0(c, i));
      return Status();
    })
    .Doc(R"doc(
selected = wire(acc[chunks in indices] * scale), chunks in index order, the
chunk indices[j] multiplied by scale[j] (or by `scale` when it is a scalar)
in float32 before the cast; residual = acc with those chunks zeroed;
new_velocity = velocity likewise. scale: float32, shape [] or [len(indices)].
)doc");

class GfGatherChunksOp : public OpKernel {
 public:
  explicit GfGatherChunksOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("chunk_size", &chunk_size_));
    OP_REQUIRES_OK(ctx, CheckChunkSize("gather_chunks", chunk_size_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("wire_dtype", &wire_dtype_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("simd", &simd_));
    int num_velocity;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_velocity", &num_velocity));
    OP_REQUIRES(ctx, num_velocity <= 1,
                InvalidArgument("gather_chunks: at most one velocity, got ", num_velocity));
    has_velocity_ = num_velocity == 1;
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& acc = ctx->input(0);
    OP_REQUIRES_OK(ctx, CheckFlatFloat("gather_chunks", "acc", acc));
    const int64_t n = acc.NumElements();
    OP_REQUIRES_OK(ctx, CheckNumChunks("gather_chunks", n, chunk_size_));
    std::vector<int64_t> rank;
    int64_t covered;
    OP_REQUIRES_OK(ctx, ChunkRanks("gather_chunks", ctx->input(1), n, chunk_size_,
                                   &rank, &covered));
    Scales scale;
    OP_REQUIRES_OK(ctx, scale.Init("GfGatherChunks", ctx->input(2), ctx->input(1).NumElements(),
                                   kPerSelectedChunk));
    if (has_velocity_) {
      const Tensor& v = ctx->input(kVelocity);
      OP_REQUIRES(ctx, v.shape() == acc.shape(),
                  InvalidArgument("gather_chunks: velocity has shape ", v.shape().DebugString(),
                                  " but acc has ", acc.shape().DebugString()));
    }

    Tensor* selected = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({covered}), &selected));
    Tensor* residual = nullptr;
    OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({0}, 1, acc.shape(), &residual));
    const float* a = acc.flat<float>().data();
    float* res = residual->flat<float>().data();
    const float* v = nullptr;
    float* v_out = nullptr;
    if (has_velocity_) {
      Tensor* t = nullptr;
      OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({kVelocity}, 2, acc.shape(), &t));
      v = ctx->input(kVelocity).flat<float>().data();
      v_out = t->flat<float>().data();
    }
    char* sel = static_cast<char*>(selected->data());
    const int wire_bytes = tensorflow::DataTypeSize(wire_dtype_);
    const bool stream = simd_ && StreamOutput(n * sizeof(float));

    ParallelFor(ctx, rank.size(), 2 * ChunkLength(n, chunk_size_), [&](int64_t first, int64_t last) {
      for (int64_t c = first; c < last; ++c) {
        const int64_t begin = c * chunk_size_;
        const int64_t bytes = std::min(chunk_size_, n - begin) * sizeof(float);
        if (rank[c] >= 0) {
          // The selected offset: all chunks before this one in `indices` are
          // full (only the last chunk of the buffer can be partial).
          ToWire(tensorflow::DT_FLOAT, a + begin, wire_dtype_,
                 sel + rank[c] * chunk_size_ * wire_bytes, bytes / sizeof(float),
                 scale[rank[c]], simd_);
          ZeroBytes(res + begin, bytes, stream && res != a);
          if (v_out) ZeroBytes(v_out + begin, bytes, stream && v_out != v);
        } else {
          // Forwarded outputs already hold the input.
          if (res != a) CopyBytes(res + begin, a + begin, bytes, stream);
          if (v_out && v_out != v) CopyBytes(v_out + begin, v + begin, bytes, stream);
        }
      }
    });
  }

 private:
  static constexpr int kVelocity = 3;  // input index of the optional velocity
  int64_t chunk_size_;
  tensorflow::DataType wire_dtype_;
  bool simd_;
  bool has_velocity_;
};

REGISTER_KERNEL_BUILDER(Name("GfGatherChunks").Device(tensorflow::DEVICE_CPU),
                        GfGatherChunksOp);

// ---------------------------------------------------------------------------

REGISTER_OP("GfScatterChunks")
    .Input("selected: wire_dtype")
    .Input("indices: Tindices")
    .Input("scale: float")
    .Output("tensors: Tout")
    .Attr("Tindices: {int32, int64}")
    .Attr("chunk_size: int")
    .Attr("wire_dtype: " GF_TF_WIRE_TYPES)
    .Attr("Tout: list(" GF_TF_GRAD_TYPES ") >= 0")
    .Attr("shapes: list(shape) >= 0")
    .Attr("simd: bool = true")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      TF_RETURN_IF_ERROR(CheckScaleShape(c, "GfScatterChunks", 2, NumIndices(c, 1),
                                         kPerSelectedChunk));
      std::vector<PartialTensorShape> shapes;
      TF_RETURN_IF_ERROR(c->GetAttr("shapes", &shapes));
      if (static_cast<int>(shapes.size()) != c->num_outputs()) {
        return InvalidArgument("GfScatterChunks: ", shapes.size(), " shapes but ",
                               c->num_outputs(), " output dtypes (Tout)");
      }
      for (int i = 0; i < c->num_outputs(); ++i) {
        shape_inference::ShapeHandle s;
        TF_RETURN_IF_ERROR(c->MakeShapeFromPartialTensorShape(shapes[i], &s));
        c->set_output(i, s);
      }
      return Status();
    })
    .Doc(R"doc(
Inverse of GfGatherChunks into unpacked tensors of `shapes`/`Tout`: inside the
chunk indices[j], float32(selected values) * scale[j] (or * `scale` when it is
a scalar), cast to the output dtype; elsewhere 0. scale: float32, shape [] or
[len(indices)].
)doc");

class GfScatterChunksOp : public OpKernel {
 public:
  explicit GfScatterChunksOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("chunk_size", &chunk_size_));
    OP_REQUIRES_OK(ctx, CheckChunkSize("scatter_chunks", chunk_size_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("wire_dtype", &wire_dtype_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("Tout", &out_dtypes_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("simd", &simd_));
    OP_REQUIRES_OK(ctx, ReadOutputShapes(ctx, "scatter_chunks", out_dtypes_.size(), &shapes_,
                                         &offsets_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& selected = ctx->input(0);
    const int64_t n = offsets_.back();
    OP_REQUIRES(ctx, selected.dims() == 1,
                InvalidArgument("scatter_chunks: selected must be 1-D, got shape ",
                                selected.shape().DebugString()));
    OP_REQUIRES_OK(ctx, CheckNumChunks("scatter_chunks", n, chunk_size_));
    std::vector<int64_t> rank;
    int64_t covered;
    OP_REQUIRES_OK(ctx, ChunkRanks("scatter_chunks", ctx->input(1), n, chunk_size_,
                                   &rank, &covered));
    OP_REQUIRES(ctx, selected.NumElements() == covered,
                InvalidArgument("scatter_chunks: selected has ", selected.NumElements(),
                                " elements but the chunks in indices cover ", covered,
                                "; they must match"));
    Scales scale;
    OP_REQUIRES_OK(ctx, scale.Init("GfScatterChunks", ctx->input(2), ctx->input(1).NumElements(),
                                   kPerSelectedChunk));
    std::vector<char*> out_data;
    OP_REQUIRES_OK(ctx, AllocateTensorsOutput(ctx, shapes_, &out_data));
    const char* sel = static_cast<const char*>(selected.data());
    const int wire_bytes = tensorflow::DataTypeSize(wire_dtype_);
    const bool stream = simd_ && StreamOutput(n * sizeof(float));

    ParallelFor(ctx, rank.size(), 2 * ChunkLength(n, chunk_size_), [&](int64_t first, int64_t last) {
      for (int64_t c = first; c < last; ++c) {
        const int64_t begin = c * chunk_size_;
        const int64_t end = std::min(n, begin + chunk_size_);
        const int64_t r = rank[c];
        ForEachSegment(offsets_, begin, end,
                       [&](int i, int64_t in_tensor, int64_t in_chunk, int64_t len) {
          const int out_bytes = tensorflow::DataTypeSize(out_dtypes_[i]);
          char* dst = out_data[i] + in_tensor * out_bytes;
          if (r >= 0) {
            FromWire(wire_dtype_, sel + (r * chunk_size_ + in_chunk) * wire_bytes,
                     out_dtypes_[i], dst, len, scale[r], simd_, stream);
          } else {
            ZeroBytes(dst, len * out_bytes, stream);  // +0.0 in every float dtype
          }
        });
      }
    });
  }

 private:
  int64_t chunk_size_;
  tensorflow::DataType wire_dtype_;
  DataTypeVector out_dtypes_;
  std::vector<TensorShape> shapes_;
  std::vector<int64_t> offsets_;
  bool simd_;
};

REGISTER_KERNEL_BUILDER(Name("GfScatterChunks").Device(tensorflow::DEVICE_CPU),
                        GfScatterChunksOp);

}  // namespace gf_tf
