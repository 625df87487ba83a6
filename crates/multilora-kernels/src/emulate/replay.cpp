// The device replay: our kernels checked on a GPU with nothing but the NVIDIA driver. It reads
// launches the host emulator recorded (`MULTILORA_EMU_RECORD=DIR`: each `NAME.ID.launch` in the
// emulator's MLEMU2 format, beside `NAME.ID.expect`, every buffer as the emulator left it), runs
// each on the device from the shipped fatbins (`cuModuleLoadData`, looked up by name), and
// compares every buffer with the emulator's. It opens libcuda.so.1 itself (dlopen): no CUDA
// runtime, cuBLAS, candle, Rust or glibc of a newer build machine is needed, so that a device
// image on which the device check's binary cannot start still has our kernels checked. Built by
// `scripts/device-check.sh build` with the host C++ compiler (nothing here is device code), its
// source travels too, to be built again there if the binary cannot start.
//
//   replay --fatbins DIR --corpus DIR [--report PREFIX] [--driver PATH]
//
// A buffer compares byte for byte where the kernel copies (the KV write, the greedy picks'
// tokens). Where it computes in floating point the device may round differently from the host
// build (nvcc contracts a * b + c to one FMA, the host build does not; expf and rsqrtf are the
// device's), so each element of an output view is compared in its own type (named by the field
// and the kernel's name): equal, or within 256 ulps (f32) / 1 ulp (bf16, f16), or within 1e-5 of
// the view's largest magnitude; NaN against NaN passes, and an infinity must match. A wrong
// index, a race or a missed write is far outside that. Bytes no view covers must be identical.
//
// Prints a line per launch and a summary; with --report, PREFIX.key (the summary line) and
// PREFIX.json (every launch). Exit status: 0 every launch ran and matched; 1 a launch failed or
// differed; 2 no CUDA device (no driver, or it reports none); 4 the corpus or a fatbin cannot be
// read.
#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "kernels.h"

namespace {

namespace fs = std::filesystem;

[[noreturn]] void die(int code, const std::string& why) {
    std::fprintf(stderr, "replay: %s\n", why.c_str());
    std::exit(code);
}

// ---- the driver, opened by hand ----------------------------------------------------------------

using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;
using CUcontext = void*;
using CUmodule = void*;
using CUfunction = void*;
using CUstream = void*;

struct Driver {
    void* lib = nullptr;
    std::string path;
    CUresult (*init)(unsigned) = nullptr;
    CUresult (*device_count)(int*) = nullptr;
    CUresult (*device_get)(CUdevice*, int) = nullptr;
    CUresult (*device_name)(char*, int, CUdevice) = nullptr;
    CUresult (*device_attribute)(int*, int, CUdevice) = nullptr;
    CUresult (*primary_retain)(CUcontext*, CUdevice) = nullptr;
    CUresult (*ctx_set)(CUcontext) = nullptr;
    CUresult (*ctx_sync)() = nullptr;
    CUresult (*module_load)(CUmodule*, const void*) = nullptr;
    CUresult (*get_function)(CUfunction*, CUmodule, const char*) = nullptr;
    CUresult (*mem_alloc)(CUdeviceptr*, size_t) = nullptr;
    CUresult (*mem_free)(CUdeviceptr) = nullptr;
    CUresult (*htod)(CUdeviceptr, const void*, size_t) = nullptr;
    CUresult (*dtoh)(void*, CUdeviceptr, size_t) = nullptr;
    CUresult (*launch)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                       void**, void**) = nullptr;
    CUresult (*error_string)(CUresult, const char**) = nullptr;

    std::string error(CUresult r) const {
        const char* s = nullptr;
        if (error_string && error_string(r, &s) == 0 && s) return std::string(s) + " (" + std::to_string(r) + ")";
        return "CUDA error " + std::to_string(r);
    }
};

template <typename F>
void bind(Driver& d, F& f, const char* name) {
    f = reinterpret_cast<F>(dlsym(d.lib, name));
    if (!f) die(2, d.path + " has no " + name + ": not an NVIDIA driver this replay can use");
}

Driver open_driver(const std::string& given) {
    Driver d;
    std::string tried;
    for (const std::string& name : given.empty() ? std::vector<std::string>{"libcuda.so.1", "libcuda.so"}
                                                 : std::vector<std::string>{given}) {
        d.lib = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
        if (d.lib) {
            d.path = name;
            break;
        }
        const char* e = dlerror();
        tried += "\n  " + name + ": " + (e ? e : "not found");
    }
    if (!d.lib) die(2, "no CUDA device: the NVIDIA driver cannot be opened:" + tried);
    bind(d, d.init, "cuInit");
    bind(d, d.device_count, "cuDeviceGetCount");
    bind(d, d.device_get, "cuDeviceGet");
    bind(d, d.device_name, "cuDeviceGetName");
    bind(d, d.device_attribute, "cuDeviceGetAttribute");
    bind(d, d.primary_retain, "cuDevicePrimaryCtxRetain");
    bind(d, d.ctx_set, "cuCtxSetCurrent");
    bind(d, d.ctx_sync, "cuCtxSynchronize");
    bind(d, d.module_load, "cuModuleLoadData");
    bind(d, d.get_function, "cuModuleGetFunction");
    bind(d, d.mem_alloc, "cuMemAlloc_v2");
    bind(d, d.mem_free, "cuMemFree_v2");
    bind(d, d.htod, "cuMemcpyHtoD_v2");
    bind(d, d.dtoh, "cuMemcpyDtoH_v2");
    bind(d, d.launch, "cuLaunchKernel");
    bind(d, d.error_string, "cuGetErrorString");
    return d;
}

// ---- files ---------------------------------------------------------------------------------------

std::vector<uint8_t> read_file(const fs::path& p) {
    std::ifstream f(p, std::ios::binary);
    if (!f) die(4, "cannot read " + p.string());
    return std::vector<uint8_t>((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

struct Cursor {
    const std::vector<uint8_t>& b;
    size_t at = 0;
    std::string file;
    void bytes(void* dst, size_t n) {
        if (n > b.size() - at) die(4, file + ": cut short at byte " + std::to_string(at));
        std::memcpy(dst, b.data() + at, n);
        at += n;
    }
    uint32_t u32() { uint32_t v; bytes(&v, 4); return v; }
    uint64_t u64() { uint64_t v; bytes(&v, 8); return v; }
    std::vector<uint8_t> blob(uint64_t n) {
        if (n > b.size() - at) die(4, file + ": a field of " + std::to_string(n) + " bytes runs past its end");
        std::vector<uint8_t> v(b.begin() + at, b.begin() + at + n);
        at += n;
        return v;
    }
};

struct View {
    uint32_t buffer = 0;
    uint64_t start = 0, len = 0;
    std::string fields;
};

struct Launch {
    std::string file, kernel;
    uint32_t grid[3] = {}, block[3] = {};
    std::vector<uint8_t> params;
    std::vector<std::vector<uint8_t>> buffers, expect;
    std::vector<View> views;
};

Launch read_launch(const fs::path& path) {
    Launch l;
    l.file = path.filename().string();
    const auto bytes = read_file(path);
    Cursor c{bytes, 0, l.file};
    char magic[8];
    c.bytes(magic, 8);
    if (std::memcmp(magic, "MLEMU2\0\0", 8) != 0) die(4, l.file + ": not an emulator launch file (MLEMU2)");
    const auto name = c.blob(c.u32());
    l.kernel.assign(name.begin(), name.end());
    for (auto& g : l.grid) g = c.u32();
    for (auto& b : l.block) b = c.u32();
    l.params = c.blob(c.u32());
    const uint32_t nbufs = c.u32();
    for (uint32_t i = 0; i < nbufs; ++i) l.buffers.push_back(c.blob(c.u64()));
    const uint32_t nviews = c.u32();
    for (uint32_t i = 0; i < nviews; ++i) {
        View v;
        v.buffer = c.u32();
        v.start = c.u64();
        v.len = c.u64();
        if (v.buffer >= nbufs || v.start > l.buffers[v.buffer].size() || v.len > l.buffers[v.buffer].size() - v.start)
            die(4, l.file + ": view " + std::to_string(i) + " lies outside its buffer");
        l.views.push_back(v);
    }
    fs::path ex = path;
    ex.replace_extension(".expect");
    const auto eb = read_file(ex);
    Cursor e{eb, 0, ex.filename().string()};
    const uint32_t n = e.u32();
    if (n != nbufs) die(4, e.file + ": " + std::to_string(n) + " buffers for a launch of " + std::to_string(nbufs));
    for (uint32_t i = 0; i < n; ++i) {
        l.expect.push_back(e.blob(e.u64()));
        if (l.expect.back().size() != l.buffers[i].size()) die(4, e.file + ": buffer " + std::to_string(i) + " of another size");
    }
    return l;
}

// ---- pointer fields ------------------------------------------------------------------------------

// The launch being fixed: its views and this run's device buffers.
Launch* g_launch = nullptr;
std::vector<CUdeviceptr> g_dev;

uint64_t fix(uint64_t value, const std::string& field = "a pointer field") {
    if (value == 0) return 0;
    const uint64_t idx = (value >> 48) - 1, off = value & ((1ull << 48) - 1);
    if (idx >= g_launch->views.size())
        die(4, g_launch->file + ": pointer field " + field + " names view " + std::to_string(idx) + " of " +
                   std::to_string(g_launch->views.size()));
    View& v = g_launch->views[idx];
    if (v.fields.find(field) == std::string::npos) v.fields += (v.fields.empty() ? "" : ", ") + field;
    return g_dev[v.buffer] + off;
}

uint64_t fix(uint64_t value, const char* field, int index) {
    return fix(value, std::string(field) + "[" + std::to_string(index) + "]");
}

#include "fix_ptrs.h"

// The parameter bytes with every pointer field made a device address.
using Fixer = std::function<std::vector<uint8_t>(const std::vector<uint8_t>&)>;

template <typename P>
Fixer fixer() {
    return [](const std::vector<uint8_t>& bytes) {
        if (bytes.size() != sizeof(P))
            die(4, g_launch->file + ": parameter struct of " + std::to_string(bytes.size()) + " bytes, expected " +
                       std::to_string(sizeof(P)));
        P p;
        std::memcpy(&p, bytes.data(), sizeof(P));
        p = fix_ptrs(p);
        std::vector<uint8_t> out(sizeof(P));
        std::memcpy(out.data(), &p, sizeof(P));
        return out;
    };
}

std::map<std::string, Fixer> kernels() {
    std::map<std::string, Fixer> k;
#define ML_REPLAY(sym, P) k[#sym] = fixer<P>();
    ML_KERNELS(ML_REPLAY)
    return k;
}

// ---- comparison ------------------------------------------------------------------------------------

enum class Elem { Exact, F32, BF16, F16, TokenLogprob };

const char* elem_name(Elem e) {
    switch (e) {
        case Elem::Exact: return "bytes";
        case Elem::F32: return "f32";
        case Elem::BF16: return "bf16";
        case Elem::F16: return "f16";
        case Elem::TokenLogprob: return "token+logprob";
    }
    return "?";
}

size_t elem_bytes(Elem e) {
    switch (e) {
        case Elem::Exact: return 1;
        case Elem::BF16: case Elem::F16: return 2;
        case Elem::F32: return 4;
        case Elem::TokenLogprob: return 8;
    }
    return 1;
}

bool starts(const std::string& s, const char* p) { return s.rfind(p, 0) == 0; }

// The element type of a view, from the first field that names it and the kernel: the f32
// partials and LoRA shrink outputs, the greedy picks' (token, logprob) pairs, the KV write's
// copies, else the kernel's activation type (the first dtype in its name).
Elem elem_of(const std::string& kernel, const std::string& fields) {
    const std::string field = fields.substr(0, fields.find_first_of("[,"));
    if (kernel == "paged_kv_write") return Elem::Exact;
    if (kernel == "greedy_rows_f32" && field == "out") return Elem::TokenLogprob;
    if (starts(field, "part_")) return Elem::F32;
    if (field == "out" && (starts(kernel, "lora_shrink") || starts(kernel, "lora_embed_shrink"))) return Elem::F32;
    size_t best = std::string::npos;
    Elem e = Elem::Exact;
    for (auto [tag, t] : {std::pair{"_f32", Elem::F32}, std::pair{"_bf16", Elem::BF16}, std::pair{"_f16", Elem::F16}}) {
        const size_t at = kernel.find(tag);
        if (at < best) best = at, e = t;
    }
    return e;
}

double f16_to_double(uint16_t h) {
    const int exp = (h >> 10) & 31, man = h & 1023;
    const double sign = (h & 0x8000) ? -1.0 : 1.0;
    if (exp == 31) return man ? NAN : sign * INFINITY;
    if (exp == 0) return sign * std::ldexp(man, -24);
    return sign * std::ldexp(1024 + man, exp - 25);
}

// A float element as a double, and its bits as an integer ordered like the values (so that
// adjacent floats are 1 apart).
struct Value {
    double v;
    int64_t ord;
};

Value value(Elem e, const uint8_t* p) {
    auto order = [](int64_t bits, int width) {
        const int64_t sign = int64_t(1) << (width - 1);
        return (bits & sign) ? -(bits & (sign - 1)) : bits;
    };
    if (e == Elem::F32 || e == Elem::TokenLogprob) {
        uint32_t b;
        float f;
        std::memcpy(&b, p, 4);
        std::memcpy(&f, p, 4);
        return {f, order(b, 32)};
    }
    uint16_t h;
    std::memcpy(&h, p, 2);
    if (e == Elem::BF16) {
        const uint32_t b = uint32_t(h) << 16;
        float f;
        std::memcpy(&f, &b, 4);
        return {f, order(h, 16)};
    }
    return {f16_to_double(h), order(h, 16)};
}

struct Outcome {
    size_t differing = 0;  // elements not bit-identical
    int64_t max_ulps = 0;
    double max_rel = 0;    // largest |Δ| over the view's largest magnitude
    std::string failure;   // the first element outside the tolerance
};

// Compares view `vi`'s elements of the device's buffer `got` with the emulator's `want`.
void compare_view(const Launch& l, size_t vi, const std::vector<uint8_t>& got, const std::vector<uint8_t>& want,
                  Outcome& o) {
    const View& v = l.views[vi];
    const Elem e = elem_of(l.kernel, v.fields);
    const size_t w = elem_bytes(e), n = v.len / w;
    const uint8_t *g = got.data() + v.start, *x = want.data() + v.start;
    const size_t fo = e == Elem::TokenLogprob ? 4 : 0;  // the float's offset in the element
    double largest = 0;
    if (e != Elem::Exact)
        for (size_t i = 0; i < n; ++i) {
            const double a = std::fabs(value(e, x + i * w + fo).v);
            if (std::isfinite(a)) largest = std::max(largest, a);
        }
    auto fail = [&](size_t i, const std::string& what) {
        if (o.failure.empty())
            o.failure = "view " + std::to_string(vi) + " (" + v.fields + ", " + elem_name(e) + ") element " +
                        std::to_string(i) + ": " + what;
    };
    for (size_t i = 0; i < n; ++i) {
        const uint8_t *gi = g + i * w, *xi = x + i * w;
        if (std::memcmp(gi, xi, w) == 0) continue;
        ++o.differing;
        if (e == Elem::Exact || (e == Elem::TokenLogprob && std::memcmp(gi, xi, 4) != 0)) {
            uint32_t a = 0, b = 0;
            std::memcpy(&a, gi, std::min<size_t>(w, 4));
            std::memcpy(&b, xi, std::min<size_t>(w, 4));
            fail(i, "the device wrote " + std::to_string(a) + ", the emulator " + std::to_string(b) + " (must be equal)");
            continue;
        }
        const Value a = value(e, gi + fo), b = value(e, xi + fo);
        if (std::isnan(a.v) && std::isnan(b.v)) continue;
        const int64_t ulps = std::llabs(a.ord - b.ord);
        const double rel = largest > 0 ? std::fabs(a.v - b.v) / largest : INFINITY;
        const bool finite = std::isfinite(a.v) && std::isfinite(b.v);
        if (finite) {
            o.max_ulps = std::max(o.max_ulps, ulps);
            o.max_rel = std::max(o.max_rel, rel);
        }
        const int64_t ulp_bound = e == Elem::F32 || e == Elem::TokenLogprob ? 256 : 1;
        if (!finite || (ulps > ulp_bound && !(rel <= 1e-5))) {
            char msg[160];
            std::snprintf(msg, sizeof msg, "the device gives %.9g, the emulator %.9g (%lld ulps apart)", a.v, b.v,
                          (long long)ulps);
            fail(i, msg);
        }
    }
    // A partial trailing element (a view whose length is no multiple of its type): bytes.
    for (size_t b = n * w; b < v.len; ++b)
        if (g[b] != x[b]) {
            ++o.differing;
            fail(n, "a trailing byte differs");
        }
}

Outcome compare(const Launch& l, const std::vector<std::vector<uint8_t>>& got) {
    Outcome o;
    for (size_t b = 0; b < got.size(); ++b) {
        if (got[b] == l.expect[b]) continue;
        std::vector<bool> covered(got[b].size(), false);
        for (size_t vi = 0; vi < l.views.size(); ++vi) {
            const View& v = l.views[vi];
            if (v.buffer != b || v.fields.empty()) continue;
            compare_view(l, vi, got[b], l.expect[b], o);
            std::fill(covered.begin() + v.start, covered.begin() + v.start + v.len, true);
        }
        for (size_t i = 0; i < got[b].size(); ++i)
            if (!covered[i] && got[b][i] != l.expect[b][i]) {
                ++o.differing;
                if (o.failure.empty())
                    o.failure = "buffer " + std::to_string(b) + " byte " + std::to_string(i) +
                                ", which no pointer field reaches, differs";
                break;
            }
    }
    return o;
}

// ---- the run ---------------------------------------------------------------------------------------

std::string json_str(const std::string& s) {
    std::string o = "\"";
    for (char c : s) {
        if (c == '"' || c == '\\') o += '\\', o += c;
        else if ((unsigned char)c < 0x20) { char b[8]; std::snprintf(b, sizeof b, "\\u%04x", c); o += b; }
        else o += c;
    }
    return o + "\"";
}

struct Args {
    std::string fatbins, corpus, report, driver;
};

Args parse(int argc, char** argv) {
    Args a;
    for (int i = 1; i < argc; ++i) {
        const std::string k = argv[i];
        if (i + 1 >= argc) die(4, "usage: replay --fatbins DIR --corpus DIR [--report PREFIX] [--driver PATH]");
        const std::string v = argv[++i];
        if (k == "--fatbins") a.fatbins = v;
        else if (k == "--corpus") a.corpus = v;
        else if (k == "--report") a.report = v;
        else if (k == "--driver") a.driver = v;
        else die(4, "unknown option " + k);
    }
    if (a.fatbins.empty() || a.corpus.empty()) die(4, "usage: replay --fatbins DIR --corpus DIR [--report PREFIX] [--driver PATH]");
    return a;
}

std::vector<fs::path> files_with(const std::string& dir, const char* ext) {
    std::vector<fs::path> out;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(dir, ec))
        if (e.path().extension() == ext) out.push_back(e.path());
    if (ec) die(4, "cannot list " + dir + ": " + ec.message());
    std::sort(out.begin(), out.end());
    return out;
}

}  // namespace

int main(int argc, char** argv) {
    const Args args = parse(argc, argv);
    const auto table = kernels();
    const auto fatbins = files_with(args.fatbins, ".fatbin");
    const auto launches = files_with(args.corpus, ".launch");
    if (fatbins.empty()) die(4, "no .fatbin in " + args.fatbins);
    if (launches.empty()) die(4, "no .launch in " + args.corpus);

    Driver d = open_driver(args.driver);
    CUresult r = d.init(0);
    int count = 0;
    if (r != 0 || d.device_count(&count) != 0 || count == 0)
        die(2, "no CUDA device: " + (r != 0 ? "cuInit: " + d.error(r) : std::string("the driver reports no device")));
    CUdevice dev = 0;
    CUcontext ctx = nullptr;
    char name[256] = {};
    int major = 0, minor = 0;
    if ((r = d.device_get(&dev, 0)) || (r = d.device_name(name, sizeof name, dev)) ||
        (r = d.device_attribute(&major, 75, dev)) || (r = d.device_attribute(&minor, 76, dev)) ||
        (r = d.primary_retain(&ctx, dev)) || (r = d.ctx_set(ctx)))
        die(2, "the device cannot be opened: " + d.error(r));
    std::printf("replay: %s (compute capability %d.%d) through %s; %zu fatbins, %zu launches\n", name, major, minor,
                d.path.c_str(), fatbins.size(), launches.size());

    std::vector<CUmodule> modules;
    for (const auto& f : fatbins) {
        const auto image = read_file(f);
        CUmodule m = nullptr;
        if ((r = d.module_load(&m, image.data())))
            die(1, f.filename().string() + " does not load on this device: " + d.error(r));
        modules.push_back(m);
    }

    size_t identical = 0, close = 0, failed = 0;
    std::string json = "{\n  \"device\": " + json_str(name) + ",\n  \"compute_capability\": \"" +
                       std::to_string(major) + "." + std::to_string(minor) + "\",\n  \"launches\": [";
    bool sticky = false;  // a launch left the context unusable: the rest are not run
    for (size_t li = 0; li < launches.size(); ++li) {
        Launch l = read_launch(launches[li]);
        std::string status, detail;
        Outcome o;
        const auto it = table.find(l.kernel);
        CUfunction fn = nullptr;
        if (sticky) {
            status = "not run";
            detail = "an earlier launch left the context unusable";
        } else if (it == table.end()) {
            status = "FAIL";
            detail = "no kernel of ours is named " + l.kernel;
        } else {
            for (CUmodule m : modules)
                if (d.get_function(&fn, m, l.kernel.c_str()) == 0) break;
            if (!fn) {
                status = "FAIL";
                detail = "no fatbin holds " + l.kernel;
            }
        }
        if (status.empty()) {
            g_launch = &l;
            g_dev.assign(l.buffers.size(), 0);
            for (size_t b = 0; b < l.buffers.size() && r == 0; ++b) {
                r = d.mem_alloc(&g_dev[b], std::max<size_t>(l.buffers[b].size(), 1));
                if (r == 0 && !l.buffers[b].empty()) r = d.htod(g_dev[b], l.buffers[b].data(), l.buffers[b].size());
            }
            std::vector<std::vector<uint8_t>> got = l.buffers;
            if (r == 0) {
                auto params = it->second(l.params);
                void* args_[] = {params.data()};
                r = d.launch(fn, l.grid[0], l.grid[1], l.grid[2], l.block[0], l.block[1], l.block[2], 0, nullptr, args_,
                             nullptr);
                if (r == 0) r = d.ctx_sync();
                for (size_t b = 0; b < got.size() && r == 0; ++b)
                    if (!got[b].empty()) r = d.dtoh(got[b].data(), g_dev[b], got[b].size());
            }
            for (CUdeviceptr p : g_dev)
                if (p) d.mem_free(p);
            if (r != 0) {
                status = "FAIL";
                detail = "the launch failed: " + d.error(r);
                sticky = true;
                r = 0;
            } else {
                o = compare(l, got);
                if (!o.failure.empty()) {
                    status = "FAIL";
                    detail = o.failure;
                } else if (o.differing == 0) {
                    status = "identical";
                } else {
                    char b[160];
                    std::snprintf(b, sizeof b, "%zu elements differ, at most %lld ulps or %.2g of the largest", o.differing,
                                  (long long)o.max_ulps, o.max_rel);
                    status = "close";
                    detail = b;
                }
            }
        }
        if (status == "identical") ++identical;
        else if (status == "close") ++close;
        else ++failed;
        std::printf("  %-9s %-40s grid (%u,%u,%u) block (%u,%u,%u)%s%s\n", status.c_str(), l.kernel.c_str(), l.grid[0],
                    l.grid[1], l.grid[2], l.block[0], l.block[1], l.block[2], detail.empty() ? "" : ": ", detail.c_str());
        json += std::string(li ? "," : "") + "\n    {\"file\": " + json_str(l.file) + ", \"kernel\": " + json_str(l.kernel) +
                ", \"status\": " + json_str(status) + ", \"detail\": " + json_str(detail) +
                ", \"differing\": " + std::to_string(o.differing) + ", \"max_ulps\": " + std::to_string(o.max_ulps) + "}";
    }
    char summary[256];
    std::snprintf(summary, sizeof summary, "%zu launches replayed from the emulator: %zu identical, %zu within rounding, %zu failed",
                  launches.size(), identical, close, failed);
    std::printf("replay: %s\n", summary);
    json += "\n  ],\n  \"summary\": " + json_str(summary) + "\n}\n";
    if (!args.report.empty()) {
        std::ofstream(args.report + ".key") << summary << "\n";
        std::ofstream(args.report + ".json") << json;
    }
    return failed ? 1 : 0;
}
