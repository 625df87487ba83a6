// Global memory of an emulated launch, bounds-checked. The launch file names buffers and the
// views of them that pointer fields point into (`(view + 1) << 48 | byte offset in the buffer`,
// 0 = null). For each run every view is copied into a mapping of its own, between PROT_NONE guard
// regions of 1 MiB, so an access outside the view faults and the SIGSEGV handler reports which
// view, which field, how far outside and from which thread. A view lies either against its upper
// guard (`Place::End`: its start rounded down to 16 bytes, so an access past the end faults from
// the first 16-byte boundary on, exactly when the length is a multiple of 16) or against its lower
// guard (`Place::Start`: an access before the start faults at once); the bytes between the view
// and a guard are poisoned and checked after the run, so a write there is reported too, and a
// read there changes the result between the two placements. The harness runs a launch once in each placement.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "emu.h"

namespace ml_views {

enum class Place { End, Start };

struct View {
    uint32_t buffer = 0;
    uint64_t start = 0, len = 0;
    // The pointer fields that name it, for reports ("x, a[1]").
    std::string fields;
    // This run's mapping (guards included), and where the view's first byte lies in it.
    char* map = nullptr;
    size_t map_len = 0, data_len = 0;
    char* base = nullptr;
    Place place = Place::End;
};

inline std::vector<std::vector<uint8_t>> g_bufs;
inline std::vector<View> g_views;
inline constexpr size_t kGuard = 1 << 20;
// The poison of the bytes around a view: 0xff against the upper guard, 0x7f against the lower, so
// a read of them changes the result between placements (0xff is a NaN in every float type).
inline uint8_t poison(Place p) { return p == Place::End ? 0xff : 0x7f; }

[[noreturn]] inline void fail(const std::string& why) {
    std::fprintf(stderr, "multilora emulator: %s\n", why.c_str());
    std::exit(2);
}

inline size_t page() { return (size_t)sysconf(_SC_PAGESIZE); }

inline std::string describe(size_t i) {
    const View& v = g_views[i];
    return "view " + std::to_string(i) + " (" + (v.fields.empty() ? std::string("no field") : v.fields) + ": buffer " +
           std::to_string(v.buffer) + " bytes [" + std::to_string(v.start) + ", " + std::to_string(v.start + v.len) + "))";
}

// Maps every view for a run, with its bytes copied in and its slack poisoned.
inline void map_all(Place place) {
    const size_t pg = page();
    for (View& v : g_views) {
        v.place = place;
        v.data_len = (v.len + 16 + pg - 1) / pg * pg;
        v.map_len = kGuard + v.data_len + kGuard;
        v.map = (char*)mmap(nullptr, v.map_len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (v.map == MAP_FAILED) fail("cannot map a view of " + std::to_string(v.len) + " bytes");
        char* data = v.map + kGuard;
        if (mprotect(data, v.data_len, PROT_READ | PROT_WRITE) != 0) fail("cannot unprotect a view");
        std::memset(data, poison(place), v.data_len);
        v.base = place == Place::Start ? data : (char*)((uintptr_t)(data + v.data_len - v.len) & ~(uintptr_t)15);
        if (v.len) std::memcpy(v.base, g_bufs[v.buffer].data() + v.start, v.len);
    }
}

// Every view's bytes after a run.
inline std::vector<std::vector<uint8_t>> snapshot() {
    std::vector<std::vector<uint8_t>> out;
    for (const View& v : g_views) out.emplace_back((const uint8_t*)v.base, (const uint8_t*)v.base + v.len);
    return out;
}

// Reports a write into the poisoned bytes around a view (found after the run).
inline void check_slack(const char* kernel) {
    for (size_t i = 0; i < g_views.size(); ++i) {
        const View& v = g_views[i];
        const char* data = v.map + kGuard;
        for (const char* p = data; p < data + v.data_len; ++p) {
            if (p >= v.base && p < v.base + v.len) continue;
            if ((uint8_t)*p == poison(v.place)) continue;
            const std::string where = p < v.base ? std::to_string(v.base - p) + " bytes before the start"
                                                 : std::to_string(p - (v.base + v.len) + 1) + " bytes past the end";
            ml_emu::fault(ml_emu::kOutOfBounds, std::string(kernel) + " writes the byte " + where + " of " + describe(i) +
                                                    " (found after the run, so the thread is not known)");
        }
    }
}

inline void unmap_all() {
    for (View& v : g_views) {
        munmap(v.map, v.map_len);
        v.map = v.base = nullptr;
    }
}

// A pointer field's value as this run's address of the byte it names.
inline uint64_t fix(uint64_t value, const std::string& field = "a pointer field") {
    if (value == 0) return 0;
    const uint64_t idx = (value >> 48) - 1, off = value & ((1ull << 48) - 1);
    if (idx >= g_views.size())
        fail("pointer field " + field + " names view " + std::to_string(idx) + " of " + std::to_string(g_views.size()));
    View& v = g_views[idx];
    if (v.fields.find(field) == std::string::npos) v.fields += (v.fields.empty() ? "" : ", ") + field;
    if (off < v.start || off > v.start + v.len)
        ml_emu::fault(ml_emu::kOutOfBounds, "pointer field " + field + " points at byte " + std::to_string(off) +
                                                " of buffer " + std::to_string(v.buffer) + ", outside " + describe(idx));
    return (uint64_t)(uintptr_t)(v.base + (off - v.start));
}

inline uint64_t fix(uint64_t value, const char* field, int index) {
    return fix(value, std::string(field) + "[" + std::to_string(index) + "]");
}

// The SIGSEGV handler: names the view an address belongs to (or says it belongs to none).
// Formats into a fixed buffer; it only reads what the running thread set up before the fault.
inline void on_segv(int, siginfo_t* si, void* uc) {
    const char* a = (const char*)si->si_addr;
    const char* verb = "accesses";
#if defined(__x86_64__) && defined(REG_ERR)
    verb = (((ucontext_t*)uc)->uc_mcontext.gregs[REG_ERR] & 2) ? "writes" : "reads";
#else
    (void)uc;
#endif
    char who[256];
    if (ml_emu::t_fiber && ml_emu::t_slot && ml_emu::g_launch) {
        const dim3 b = ml_emu::t_slot->idx, t = ml_emu::t_fiber->idx;
        std::snprintf(who, sizeof who, "%s block (%u,%u,%u) thread (%u,%u,%u)", ml_emu::g_launch->kernel, b.x, b.y, b.z,
                      t.x, t.y, t.z);
    } else {
        std::snprintf(who, sizeof who, "the harness itself");
    }
    char msg[1024];
    for (size_t i = 0; i < g_views.size(); ++i) {
        const View& v = g_views[i];
        if (!v.map || a < v.map || a >= v.map + v.map_len) continue;
        const long long off = (long long)(a - v.base);
        std::snprintf(msg, sizeof msg, "%s %s byte %lld of view %zu (%s: buffer %u bytes [%llu, %llu)), %s", who, verb, off,
                      i, v.fields.empty() ? "no field" : v.fields.c_str(), v.buffer, (unsigned long long)v.start,
                      (unsigned long long)(v.start + v.len), off < 0 ? "before its start" : "past its end");
        ml_emu::fault(ml_emu::kOutOfBounds, msg);
    }
    if (ml_emu::in_stack_guard(a)) {
        std::snprintf(msg, sizeof msg, "%s overflows its %zu-byte stack", who, ml_emu::kStackBytes);
        ml_emu::fault(ml_emu::kOutOfBounds, msg);
    }
    std::snprintf(msg, sizeof msg, "%s %s address %p, outside every view (a wild pointer)", who, verb, (const void*)a);
    ml_emu::fault(ml_emu::kOutOfBounds, msg);
}

inline void install_handler() {
    struct sigaction sa{};
    sa.sa_sigaction = on_segv;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, nullptr);
    sigaction(SIGBUS, &sa, nullptr);
}

// The buffers with every view's result written back. Views that overlap and write one byte
// differently are a fault.
inline std::vector<std::vector<uint8_t>> write_back(const std::vector<std::vector<uint8_t>>& result, const char* kernel) {
    std::vector<std::vector<uint8_t>> out = g_bufs;
    for (size_t i = 0; i < g_views.size(); ++i) {
        const View& v = g_views[i];
        const uint8_t* orig = g_bufs[v.buffer].data() + v.start;
        uint8_t* dst = out[v.buffer].data() + v.start;
        for (uint64_t b = 0; b < v.len; ++b) {
            if (result[i][b] == orig[b]) continue;
            if (dst[b] != orig[b] && dst[b] != result[i][b])
                ml_emu::fault(ml_emu::kRace, std::string(kernel) + " writes buffer " + std::to_string(v.buffer) +
                                                 " byte " + std::to_string(v.start + b) +
                                                 " differently through two overlapping views, " + describe(i) +
                                                 " and another");
            dst[b] = result[i][b];
        }
    }
    return out;
}

}  // namespace ml_views
