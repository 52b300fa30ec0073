// Low-rank (PowerSGD) compression ops: the three passes over each n x m
// matrix that the compressed step needs, fused so that each reads the matrix
// once and writes it at most twice.
//   GfLowRankProject:    M = float(grad) + residual; P = M Q; the largest
//                        column norm of M (the bound of M^T P^ on the wire).
//   GfLowRankProjectBack: Q = M^T P.
//   GfLowRankReconstruct: out = A B^T (the reduced gradient);
//                        residual = M - C D^T (error feedback), in M's
//                        buffer when TensorFlow lets us.
// P, Q and the reconstruction sum over fixed lanes and row blocks in a fixed
// order: their bits depend on the inputs and shapes, not on the thread count.
// The column bound's float partial sums follow the threads' shards (it only
// picks a power-of-two scale, and is all-reduced before use).
// Source: Vogels, Karimireddy and Jaggi, "PowerSGD" (NeurIPS 2019), Alg. 1-2.
#include <cmath>
#include <mutex>
#include <string>
#include <vector>

#include "gf_kernels.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor_shape.h"

namespace gf_tf {

using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Status;
using tensorflow::Tensor;
using tensorflow::TensorShape;
using tensorflow::errors::InvalidArgument;
namespace shape_inference = tensorflow::shape_inference;

namespace {

constexpr int kLanes = 8;

// sum_j x[j] * y[j] over kLanes partial sums, added in lane order.
inline float Dot(const float* x, const float* y, int64_t m) {
  float lanes[kLanes] = {0};
  int64_t j = 0;
  for (; j + kLanes <= m; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) lanes[l] += x[j + l] * y[j + l];
  }
  for (int64_t l = 0; j < m; ++j, ++l) lanes[l] += x[j] * y[j];
  float sum = 0.0f;
  for (int l = 0; l < kLanes; ++l) sum += lanes[l];
  return sum;
}

// dst[k * m + j] = src[j * r + k]: a factor [m, r] as r contiguous columns.
std::vector<float> Columns(const Tensor& factor, int64_t m, int64_t r) {
  std::vector<float> columns(m * r);
  const float* src = factor.flat<float>().data();
  for (int64_t j = 0; j < m; ++j) {
    for (int64_t k = 0; k < r; ++k) columns[k * m + j] = src[j * r + k];
  }
  return columns;
}

std::string Dim(int64_t d) { return d < 0 ? "?" : std::to_string(d); }

// Checks `t` is a 2-D [rows, cols] tensor (-1: any); names op and input.
Status CheckMatrix(const char* op, const char* name, const Tensor& t, int64_t rows,
                   int64_t cols) {
  if (t.dims() != 2 || (rows >= 0 && t.dim_size(0) != rows) ||
      (cols >= 0 && t.dim_size(1) != cols)) {
    return InvalidArgument(op, ": ", name, " must have shape [", Dim(rows), ", ", Dim(cols),
                           "], got ", t.shape().DebugString());
  }
  return Status();
}

// Rows of n x m per ParallelFor unit: a cost in cycles of about 2 per element.
int64_t RowCost(int64_t m, int64_t r) { return std::max<int64_t>(1, (2 + r) * m); }

Status MatrixByFactor(shape_inference::InferenceContext* c, int matrix, int factor,
                      int output) {
  shape_inference::ShapeHandle mat, f;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(matrix), 2, &mat));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(factor), 2, &f));
  c->set_output(output, c->Matrix(c->Dim(mat, 0), c->Dim(f, 1)));
  return Status();
}

}  // namespace

REGISTER_OP("GfLowRankProject")
    .Input("grad: T")
    .Input("residual: float")
    .Input("q: float")
    .Output("matrix: float")
    .Output("p: float")
    .Output("column_bound: float")
    .Attr("T: " GF_TF_GRAD_TYPES)
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle grad;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &grad));
      c->set_output(0, grad);
      TF_RETURN_IF_ERROR(MatrixByFactor(c, 0, 2, 1));
      c->set_output(2, c->Scalar());
      return Status();
    })
    .Doc(R"doc(
matrix = float(grad) + residual ([n, m]); p = matrix q ([n, r]);
column_bound = sqrt(max_j sum_i matrix[i, j]^2) (0 for m == 0). One pass.
)doc");

class GfLowRankProjectOp : public OpKernel {
 public:
  explicit GfLowRankProjectOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& grad = ctx->input(0);
    const Tensor& residual = ctx->input(1);
    const Tensor& q = ctx->input(2);
    OP_REQUIRES_OK(ctx, CheckMatrix("lowrank_project", "grad", grad, -1, -1));
    const int64_t n = grad.dim_size(0), m = grad.dim_size(1);
    OP_REQUIRES_OK(ctx, CheckMatrix("lowrank_project", "residual", residual, n, m));
    OP_REQUIRES_OK(ctx, CheckMatrix("lowrank_project", "q", q, m, -1));
    const int64_t r = q.dim_size(1);
    Tensor* matrix = nullptr;
    OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({1}, 0, grad.shape(), &matrix));
    Tensor* p = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({n, r}), &p));
    Tensor* bound = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({}), &bound));
    const std::vector<float> columns = Columns(q, m, r);
    const float* res = residual.flat<float>().data();
    float* mat = matrix->flat<float>().data();
    float* pd = p->flat<float>().data();
    std::vector<double> squares(m, 0.0);
    std::mutex mu;
    const bool stream = mat != res && StreamOutput(matrix->TotalBytes());
    const char* grad_bytes = static_cast<const char*>(grad.data());
    const int64_t grad_size = tensorflow::DataTypeSize(grad.dtype());
    ParallelFor(ctx, n, RowCost(m, r), [&](int64_t first, int64_t last) {
      std::vector<float> local(m, 0.0f), row(m);
      for (int64_t i = first; i < last; ++i) {
        AccumulateSegment(res + i * m, grad.dtype(), grad_bytes + i * m * grad_size, nullptr,
                          nullptr, 0.0f, row.data(), m, /*simd=*/true);
        for (int64_t j = 0; j < m; ++j) local[j] += row[j] * row[j];
        for (int64_t k = 0; k < r; ++k) {
          pd[i * r + k] = Dot(row.data(), columns.data() + k * m, m);
        }
        CopyBytes(mat + i * m, row.data(), m * sizeof(float), stream);
      }
      std::lock_guard<std::mutex> lock(mu);
      for (int64_t j = 0; j < m; ++j) squares[j] += local[j];
    });
    double largest = 0.0;
    for (int64_t j = 0; j < m; ++j) {
      if (std::isnan(squares[j])) {
        largest = squares[j];
        break;
      }
      largest = std::max(largest, squares[j]);
    }
    bound->scalar<float>()() = static_cast<float>(std::sqrt(largest));
  }
};

REGISTER_KERNEL_BUILDER(Name("GfLowRankProject").Device(tensorflow::DEVICE_CPU),
                        GfLowRankProjectOp);

REGISTER_OP("GfLowRankProjectBack")
    .Input("matrix: float")
    .Input("p: float")
    .Output("q: float")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle mat, p;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &mat));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 2, &p));
      c->set_output(0, c->Matrix(c->Dim(mat, 1), c->Dim(p, 1)));
      return Status();
    })
    .Doc(R"doc(
q = matrix^T p: [m, r] from matrix [n, m] and p [n, r]. One pass over matrix.
)doc");

class GfLowRankProjectBackOp : public OpKernel {
 public:
  explicit GfLowRankProjectBackOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& matrix = ctx->input(0);
    const Tensor& p = ctx->input(1);
    OP_REQUIRES_OK(ctx, CheckMatrix("lowrank_project_back", "matrix", matrix, -1, -1));
    const int64_t n = matrix.dim_size(0), m = matrix.dim_size(1);
    OP_REQUIRES_OK(ctx, CheckMatrix("lowrank_project_back", "p", p, n, -1));
    const int64_t r = p.dim_size(1);
    Tensor* q = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({m, r}), &q));
    const float* mat = matrix.flat<float>().data();
    const float* pd = p.flat<float>().data();
    // Per block of rows, the columns' partial sums [r][m] in float; the blocks
    // are fixed (not the threads' shards) and added in order, in double.
    // At most 256 blocks of at least max(64, 8 r) rows: the partial sums stay within
    // 256 r m floats and an eighth of the matrix.
    const int64_t block = std::max({int64_t{64}, 8 * r, NumChunks(n, 256)});
    const int64_t blocks = NumChunks(n, block);
    std::vector<float> partial(blocks * r * m, 0.0f);
    ParallelFor(ctx, blocks, RowCost(m, r) * block, [&](int64_t first, int64_t last) {
      for (int64_t b = first; b < last; ++b) {
        float* sums = partial.data() + b * r * m;
        for (int64_t i = b * block; i < std::min(n, (b + 1) * block); ++i) {
          const float* row = mat + i * m;
          for (int64_t k = 0; k < r; ++k) {
            const float pk = pd[i * r + k];
            float* s = sums + k * m;
            for (int64_t j = 0; j < m; ++j) s[j] += row[j] * pk;
          }
        }
      }
    });
    float* qd = q->flat<float>().data();
    ParallelFor(ctx, m, blocks * r, [&](int64_t first, int64_t last) {
      for (int64_t j = first; j < last; ++j) {
        for (int64_t k = 0; k < r; ++k) {
          double sum = 0.0;
          for (int64_t b = 0; b < blocks; ++b) sum += partial[(b * r + k) * m + j];
          qd[j * r + k] = static_cast<float>(sum);
        }
      }
    });
  }
};

REGISTER_KERNEL_BUILDER(Name("GfLowRankProjectBack").Device(tensorflow::DEVICE_CPU),
                        GfLowRankProjectBackOp);

REGISTER_OP("GfLowRankReconstruct")
    .Input("matrix: float")
    .Input("a: float")
    .Input("b: float")
    .Input("c: float")
    .Input("d: float")
    .Output("out: Tout")
    .Output("residual: float")
    .Attr("Tout: " GF_TF_GRAD_TYPES)
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle mat;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &mat));
      c->set_output(0, mat);
      c->set_output(1, mat);
      return Status();
    })
    .Doc(R"doc(
out = Tout(a b^T); residual = matrix - c d^T. matrix [n, m], a and c [n, r],
b and d [m, r]. One pass over matrix; residual may take its buffer.
)doc");

class GfLowRankReconstructOp : public OpKernel {
 public:
  explicit GfLowRankReconstructOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const char* op = "lowrank_reconstruct";
    const Tensor& matrix = ctx->input(0);
    OP_REQUIRES_OK(ctx, CheckMatrix(op, "matrix", matrix, -1, -1));
    const int64_t n = matrix.dim_size(0), m = matrix.dim_size(1);
    OP_REQUIRES_OK(ctx, CheckMatrix(op, "a", ctx->input(1), n, -1));
    const int64_t r = ctx->input(1).dim_size(1);
    OP_REQUIRES_OK(ctx, CheckMatrix(op, "b", ctx->input(2), m, r));
    OP_REQUIRES_OK(ctx, CheckMatrix(op, "c", ctx->input(3), n, r));
    OP_REQUIRES_OK(ctx, CheckMatrix(op, "d", ctx->input(4), m, r));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, matrix.shape(), &out));
    Tensor* residual = nullptr;
    OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({0}, 1, matrix.shape(), &residual));
    const std::vector<float> b = Columns(ctx->input(2), m, r);
    const std::vector<float> d = Columns(ctx->input(4), m, r);
    const float* a = ctx->input(1).flat<float>().data();
    const float* c = ctx->input(3).flat<float>().data();
    const float* mat = matrix.flat<float>().data();
    float* res = residual->flat<float>().data();
    const DataType out_dtype = out->dtype();
    char* out_bytes = static_cast<char*>(out->data());
    const int64_t out_size = tensorflow::DataTypeSize(out_dtype);
    // Both outputs are written from a row in L1: streamed past the caches when large.
    const bool stream = StreamOutput(out->TotalBytes());
    ParallelFor(ctx, n, RowCost(m, 2 * r), [&](int64_t first, int64_t last) {
      std::vector<float> row(m);
      // row = sum_k left[i, k] right[:, k], k ascending.
      auto product = [&](const float* left, const std::vector<float>& right, int64_t i) {
        std::fill(row.begin(), row.end(), 0.0f);
        for (int64_t k = 0; k < r; ++k) {
          const float lk = left[i * r + k];
          const float* rk = right.data() + k * m;
          for (int64_t j = 0; j < m; ++j) row[j] += lk * rk[j];
        }
      };
      for (int64_t i = first; i < last; ++i) {
        product(a, b, i);
        FromWire(tensorflow::DT_FLOAT, row.data(), out_dtype, out_bytes + i * m * out_size, m,
                 1.0f, /*simd=*/true, stream);
        product(c, d, i);
        for (int64_t j = 0; j < m; ++j) row[j] = mat[i * m + j] - row[j];
        CopyBytes(res + i * m, row.data(), m * sizeof(float), stream);
      }
    });
  }
};

REGISTER_KERNEL_BUILDER(Name("GfLowRankReconstruct").Device(tensorflow::DEVICE_CPU),
                        GfLowRankReconstructOp);

}  // namespace gf_tf
