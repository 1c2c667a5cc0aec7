// Eager calls of the Triton kernels without Python between the call and its launches (docs/flash_attention.md §9,
// "Launches without Python"; native.py builds this file and records what it runs).
//
// A dense call's plan (dispatch.py) is a fixed list of launches: only the tensors' addresses change from call to
// call. native.py records a plan's launches once, as the Python path runs them, and hands them here as passes: the
// tensors a pass allocates, and for each launch its CUfunction, grid and parameter block, constants in place. Later
// calls of the key come here: the forward and the backward (an autograd node in C++, run on autograd's thread
// without the GIL) allocate their tensors, write the addresses into the parameter blocks, encode the tensor maps and
// launch. What this file knows of Triton is only what native.py wrote into the blocks.
#include <torch/extension.h>
#include <torch/csrc/autograd/custom_function.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>
#include <dlfcn.h>

#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace py = pybind11;
using torch::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

// --- the driver, looked up in libcuda as Triton's launcher does (no link-time dependency on it) ---------------------
using LaunchKernelEx = CUresult (*)(const CUlaunchConfig*, CUfunction, void**, void**);
using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
using GetErrorString = CUresult (*)(CUresult, const char**);

struct Driver {
  LaunchKernelEx launch = nullptr;
  EncodeTiled encode_tiled = nullptr;
  GetErrorString error_string = nullptr;

  Driver() {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) throw std::runtime_error("libcuda.so.1 could not be opened");
    launch = reinterpret_cast<LaunchKernelEx>(dlsym(lib, "cuLaunchKernelEx"));
    encode_tiled = reinterpret_cast<EncodeTiled>(dlsym(lib, "cuTensorMapEncodeTiled"));
    error_string = reinterpret_cast<GetErrorString>(dlsym(lib, "cuGetErrorString"));
    if (launch == nullptr || encode_tiled == nullptr || error_string == nullptr)
      throw std::runtime_error("libcuda.so.1 lacks cuLaunchKernelEx or cuTensorMapEncodeTiled (a CUDA 12 driver has them)");
  }

  void check(CUresult result, const char* what) const {
    if (result == CUDA_SUCCESS) return;
    const char* text = nullptr;
    error_string(result, &text);
    throw std::runtime_error(std::string("nanoflash native launch: ") + what + " failed: " + (text ? text : "?"));
  }
};

const Driver& driver() {
  static const Driver loaded;
  return loaded;
}

// --- passes: what one forward or backward call allocates and launches -----------------------------------------------
constexpr int kMaxMaps = 16;  // tensor maps per launch (the Hopper backward's main kernel takes nine)

// A parameter filled per call: a pointer into one of the call's tensors, or a tensor map (TMA descriptor) of it
struct Slot {
  bool is_map;
  int64_t place;   // a pointer's byte offset in the parameter block; a tensor map's index among the launch's maps
  int64_t root;    // the tensor: Pass roots (the call's, then the pass's outputs, then its buffers)
  int64_t offset;  // bytes from that tensor's address
  // a tensor map's fixed fields, innermost dimension first (cuTensorMapEncodeTiled's order)
  int64_t elem_type = 0, rank = 0, swizzle = 0, fill = 0;
  cuuint64_t dims[5] = {}, strides[5] = {};  // rank - 1 byte strides
  cuuint32_t box[5] = {};
};

struct Launch {
  CUfunction function;
  unsigned grid[3];
  unsigned threads, shared, ctas;
  bool pdl, cooperative;
  std::vector<uint8_t> block;   // the parameters, constants in place
  std::vector<int64_t> params;  // each kernel parameter: its byte offset in block, or -1 - i for tensor map i
  std::vector<Slot> slots;
};

struct Output {  // a tensor the pass allocates and returns
  std::vector<int64_t> sizes, strides;
  at::ScalarType dtype;
};

struct Pass {
  std::vector<Output> outputs;
  std::vector<int64_t> buffers;  // bytes of each scratch tensor it allocates and drops
  std::vector<Launch> launches;
};

void run_launch(const Launch& launch, const std::vector<Tensor>& roots, CUstream stream) {
  const Driver& cuda = driver();
  thread_local std::vector<uint8_t> block;
  thread_local std::vector<void*> params;
  alignas(64) CUtensorMap maps[kMaxMaps];
  block = launch.block;
  for (const Slot& slot : launch.slots) {
    uint64_t address = reinterpret_cast<uint64_t>(roots[slot.root].data_ptr()) + slot.offset;
    if (!slot.is_map) {
      std::memcpy(block.data() + slot.place, &address, sizeof(address));
      continue;
    }
    const cuuint32_t element_strides[5] = {1, 1, 1, 1, 1};
    cuda.check(cuda.encode_tiled(&maps[slot.place], static_cast<CUtensorMapDataType>(slot.elem_type),
                                 static_cast<cuuint32_t>(slot.rank), reinterpret_cast<void*>(address), slot.dims,
                                 slot.strides, slot.box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                 static_cast<CUtensorMapSwizzle>(slot.swizzle), CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                                 static_cast<CUtensorMapFloatOOBfill>(slot.fill)),
               "cuTensorMapEncodeTiled");
  }
  params.resize(launch.params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    int64_t place = launch.params[i];
    params[i] = place >= 0 ? static_cast<void*>(block.data() + place) : static_cast<void*>(&maps[-1 - place]);
  }
  if (static_cast<uint64_t>(launch.grid[0]) * launch.grid[1] * launch.grid[2] == 0) return;
  CUlaunchAttribute attributes[4];
  unsigned n = 0;
  if (launch.pdl) {
    attributes[n].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attributes[n++].value.programmaticStreamSerializationAllowed = 1;
  }
  if (launch.cooperative) {
    attributes[n].id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
    attributes[n++].value.cooperative = 1;
  }
  if (launch.ctas != 1) {
    attributes[n].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attributes[n].value.clusterDim.x = launch.ctas;
    attributes[n].value.clusterDim.y = 1;
    attributes[n++].value.clusterDim.z = 1;
    attributes[n].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE;
    attributes[n++].value.clusterSchedulingPolicyPreference = CU_CLUSTER_SCHEDULING_POLICY_SPREAD;
  }
  CUlaunchConfig config = {};
  config.gridDimX = launch.grid[0] * launch.ctas;
  config.gridDimY = launch.grid[1];
  config.gridDimZ = launch.grid[2];
  config.blockDimX = launch.threads;
  config.blockDimY = 1;
  config.blockDimZ = 1;
  config.sharedMemBytes = launch.shared;
  config.hStream = stream;
  config.attrs = attributes;
  config.numAttrs = n;
  cuda.check(cuda.launch(&config, launch.function, params.data(), nullptr), "cuLaunchKernelEx");
}

// roots: the call's tensors; -> the pass's outputs (roots then holds its outputs and buffers too)
std::vector<Tensor> run_pass(const Pass& pass, std::vector<Tensor>& roots) {
  const at::TensorOptions options = roots.front().options();  // (not a reference into roots, which grows)
  c10::cuda::CUDAGuard guard(options.device());
  std::vector<Tensor> outputs;
  for (const Output& out : pass.outputs) {
    outputs.push_back(at::empty_strided(out.sizes, out.strides, options.dtype(out.dtype)));
    roots.push_back(outputs.back());
  }
  for (int64_t bytes : pass.buffers) roots.push_back(at::empty({bytes}, options.dtype(at::kByte)));
  CUstream stream = c10::cuda::getCurrentCUDAStream(options.device().index()).stream();
  for (const Launch& launch : pass.launches) run_launch(launch, roots, stream);
  return outputs;
}

// --- keys: a call takes a plan kept for the same layouts, settings and scale (dispatch.py's plan keys) -------------
using Key = std::vector<int64_t>;

struct KeyHash {
  size_t operator()(const Key& key) const {
    size_t h = key.size();
    for (int64_t x : key) h ^= std::hash<int64_t>{}(x) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
    return h;
  }
};

void add_layout(Key& key, const Tensor& t) {
  key.push_back(static_cast<int64_t>(t.scalar_type()));
  key.push_back(t.dim());
  for (int64_t size : t.sizes()) key.push_back(size);
  for (int64_t stride : t.strides()) key.push_back(stride);
  key.push_back(reinterpret_cast<uint64_t>(t.data_ptr()) % 16 == 0);
}

Key forward_key(const std::vector<Tensor>& tensors, bool causal, double scale) {
  int64_t scale_bits;
  std::memcpy(&scale_bits, &scale, sizeof(scale));
  Key key{static_cast<int64_t>(tensors.size()), causal, scale_bits, at::globalContext().deterministicAlgorithms()};
  for (const Tensor& t : tensors) {
    if (!t.is_cuda()) return {};
    key.push_back(t.get_device());
    add_layout(key, t);
  }
  return key;
}

Key backward_key(const Tensor& grad_out) {
  Key key{at::globalContext().deterministicAlgorithms()};
  add_layout(key, grad_out);
  return key;
}

struct Plan {
  Pass forward;
  std::unordered_map<Key, Pass, KeyHash> backward;  // by dO's layout
};

// Plans are added from Python (the GIL held) and read on autograd's thread (without it): a lock guards the tables
std::mutex plans_lock;
constexpr size_t kMaxPlans = 4096;  // launch.MAX_KEYS
std::unordered_map<int64_t, std::shared_ptr<Plan>> plans;
std::unordered_map<Key, int64_t, KeyHash> plan_of;
int64_t next_plan = 0;
PyObject* backward_miss = nullptr;  // native.py's: a backward without a kept pass takes the Python path

std::shared_ptr<Plan> find_plan(int64_t id) {
  std::lock_guard<std::mutex> hold(plans_lock);
  auto found = plans.find(id);
  return found == plans.end() ? nullptr : found->second;
}

// roots: dO, then the forward's saved tensors; -> the gradients of the forward's inputs
std::vector<Tensor> run_backward(int64_t id, std::vector<Tensor> roots) {
  std::shared_ptr<Plan> plan = find_plan(id);
  const Pass* pass = nullptr;
  if (plan != nullptr) {
    std::lock_guard<std::mutex> hold(plans_lock);
    auto found = plan->backward.find(backward_key(roots.front()));
    pass = found == plan->backward.end() ? nullptr : &found->second;
  }
  if (pass != nullptr) return run_pass(*pass, roots);
  py::gil_scoped_acquire gil;
  py::tuple args(roots.size() + 1);
  args[0] = py::int_(id);
  for (size_t i = 0; i < roots.size(); ++i) args[i + 1] = py::cast(roots[i]);
  return py::reinterpret_borrow<py::object>(backward_miss)(*args).cast<std::vector<Tensor>>();
}

// The autograd nodes' two halves. forward: the plan's forward on inputs (q, k, v, or a packed qkv) -> (o, lse), the
// inputs, o and lse saved for the backward
variable_list forward_node(AutogradContext* ctx, std::vector<Tensor> inputs, int64_t id, const Plan& plan) {
  std::vector<Tensor> roots = inputs;
  std::vector<Tensor> out = run_pass(plan.forward, roots);
  inputs.insert(inputs.end(), out.begin(), out.end());
  ctx->save_for_backward(inputs);
  ctx->saved_data["plan"] = id;
  ctx->mark_non_differentiable({out[1]});
  return out;
}

// -> the gradients of the node's n_inputs tensors, and none of its plan (its id and pointer)
variable_list backward_node(AutogradContext* ctx, const variable_list& grads, size_t n_inputs) {
  std::vector<Tensor> roots{grads[0]};
  for (const Tensor& t : ctx->get_saved_variables()) roots.push_back(t);
  variable_list out = run_backward(ctx->saved_data["plan"].toInt(), roots);
  out.resize(n_inputs + 2);
  return out;
}

// q, k, v given apart, or as one packed (B, T, 3, H, D) tensor whose gradient is one tensor
struct Attention : public torch::autograd::Function<Attention> {
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v, int64_t id,
                               std::shared_ptr<Plan> plan) {
    return forward_node(ctx, {q, k, v}, id, *plan);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) { return backward_node(ctx, grads, 3); }
};

struct PackedAttention : public torch::autograd::Function<PackedAttention> {
  static variable_list forward(AutogradContext* ctx, const Tensor& qkv, int64_t id, std::shared_ptr<Plan> plan) {
    return forward_node(ctx, {qkv}, id, *plan);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) { return backward_node(ctx, grads, 1); }
};

// -> the plan kept for these tensors' key, or -1
int64_t plan_for(const std::vector<Tensor>& tensors, bool causal, double scale, std::shared_ptr<Plan>& plan) {
  Key key = forward_key(tensors, causal, scale);
  std::lock_guard<std::mutex> hold(plans_lock);
  auto found = plan_of.find(key);
  if (key.empty() || found == plan_of.end()) return -1;
  plan = plans.at(found->second);
  return found->second;
}

py::object forward(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale) {
  std::shared_ptr<Plan> plan;
  int64_t id = plan_for({q, k, v}, causal, scale, plan);
  if (id < 0) return py::none();
  variable_list out = Attention::apply(q, k, v, id, plan);
  return py::make_tuple(out[0], out[1]);
}

py::object forward_packed(const Tensor& qkv, bool causal, double scale) {
  std::shared_ptr<Plan> plan;
  int64_t id = plan_for({qkv}, causal, scale, plan);
  if (id < 0) return py::none();
  variable_list out = PackedAttention::apply(qkv, id, plan);
  return py::make_tuple(out[0], out[1]);
}

// --- passes from native.py's tuples -----------------------------------------------------------------------------------
Slot slot_of(const py::tuple& t) {
  Slot slot;
  slot.is_map = t[0].cast<bool>();
  slot.place = t[1].cast<int64_t>();
  slot.root = t[2].cast<int64_t>();
  slot.offset = t[3].cast<int64_t>();
  if (!slot.is_map) return slot;
  slot.elem_type = t[4].cast<int64_t>();
  slot.swizzle = t[5].cast<int64_t>();
  slot.fill = t[6].cast<int64_t>();
  auto dims = t[7].cast<std::vector<uint64_t>>(), strides = t[8].cast<std::vector<uint64_t>>();
  auto box = t[9].cast<std::vector<uint32_t>>();
  slot.rank = static_cast<int64_t>(dims.size());
  if (slot.rank < 1 || slot.rank > 5 || strides.size() + 1 != dims.size() || box.size() != dims.size() ||
      slot.place >= kMaxMaps)
    throw std::invalid_argument("a tensor map of rank 1..5 with rank - 1 strides");
  std::copy(dims.begin(), dims.end(), slot.dims);
  std::copy(strides.begin(), strides.end(), slot.strides);
  std::copy(box.begin(), box.end(), slot.box);
  return slot;
}

Launch launch_of(const py::tuple& t) {
  Launch launch;
  launch.function = reinterpret_cast<CUfunction>(t[0].cast<uint64_t>());
  auto grid = t[1].cast<std::vector<unsigned>>();
  std::copy(grid.begin(), grid.end(), launch.grid);
  launch.threads = t[2].cast<unsigned>();
  launch.shared = t[3].cast<unsigned>();
  launch.ctas = t[4].cast<unsigned>();
  launch.pdl = t[5].cast<bool>();
  launch.cooperative = t[6].cast<bool>();
  std::string block = t[7].cast<std::string>();
  launch.block.assign(block.begin(), block.end());
  launch.params = t[8].cast<std::vector<int64_t>>();
  for (const py::handle& slot : t[9].cast<py::list>()) launch.slots.push_back(slot_of(slot.cast<py::tuple>()));
  return launch;
}

// pass: (outputs: tensors shaped, strided and typed like the pass's, buffers: bytes, launches: launch_of's tuples)
Pass pass_of(const py::tuple& t) {
  Pass pass;
  for (const Tensor& like : t[0].cast<std::vector<Tensor>>())
    pass.outputs.push_back({like.sizes().vec(), like.strides().vec(), like.scalar_type()});
  pass.buffers = t[1].cast<std::vector<int64_t>>();
  for (const py::handle& launch : t[2].cast<py::list>()) pass.launches.push_back(launch_of(launch.cast<py::tuple>()));
  return pass;
}

int64_t add_plan(const std::vector<Tensor>& tensors, bool causal, double scale, const py::tuple& forward_pass) {
  driver();  // fail here, in Python, if the driver lacks an entry point
  auto plan = std::make_shared<Plan>();
  plan->forward = pass_of(forward_pass);
  Key key = forward_key(tensors, causal, scale);
  if (key.empty()) throw std::invalid_argument("the native path keeps plans of CUDA tensors only");
  std::lock_guard<std::mutex> hold(plans_lock);
  if (plans.size() >= kMaxPlans) {  // a run over ever-new shapes: start over, as launch.py's kept launches do
    plans.clear();
    plan_of.clear();
  }
  int64_t id = next_plan++;
  plans[id] = plan;
  plan_of[key] = id;
  return id;
}

void add_backward(int64_t id, const Tensor& grad_out, const py::tuple& backward_pass) {
  Pass pass = pass_of(backward_pass);
  std::shared_ptr<Plan> plan = find_plan(id);
  if (plan == nullptr) return;  // forgotten meanwhile
  std::lock_guard<std::mutex> hold(plans_lock);
  plan->backward[backward_key(grad_out)] = std::move(pass);
}

void forget() {
  std::lock_guard<std::mutex> hold(plans_lock);
  plans.clear();
  plan_of.clear();
}

void set_backward_miss(py::object fn) {
  Py_XDECREF(backward_miss);
  backward_miss = fn.release().ptr();  // kept to the end of the process (never freed after Python's finalization)
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward, "(o, lse) by the plan kept for q, k, v's key, or None");
  m.def("forward_packed", &forward_packed, "(o, lse) by the plan kept for the packed qkv's key, or None");
  m.def("add_plan", &add_plan, "keep a forward pass for these tensors' key -> the plan's id");
  m.def("add_backward", &add_backward, "keep a backward pass of plan id for dO's layout");
  m.def("forget", &forget, "drop every plan");
  m.def("set_backward_miss", &set_backward_miss, "fn(id, dO, *saved) -> gradients, for a backward without a pass");
}
