// Plans a KV-cache transfer through kvplan's C ABI and moves real bytes with a host-memory
// copier (one memcpy per block) between two host arenas, then checks every destination byte
// against a naive per-page expectation.
//
// The prefill peer registers an MHA pool (K entries for every layer, then V entries) with
// layer ids; the decode peer registers the same layers in reverse order, so pairing by layer
// id matters. The request is fragmented on both sides. The example also shows the error path
// (a too-small buffer, an index out of range, a freed handle).
//
// Build (from rust/kvplan-capi, after `cargo build -p kvplan-capi`):
//   g++ -std=c++17 -Wall -Wextra -Werror -I include examples/plan_copy.cpp
//       ../../target/debug/libkvplan_capi.a -lpthread -ldl -lm -o plan_copy && ./plan_copy
// (one command line; `cargo test -p kvplan-capi --test c_programs` does exactly this).
// Exits 0 and prints "plan_copy: OK" when every check passed.

#include "kvplan.h"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr size_t kLayers = 4;
constexpr uint64_t kPages = 32;      // pages per entry on each side
constexpr uint64_t kItemK = 256;     // bytes of one K page
constexpr uint64_t kItemV = 192;     // bytes of one V page (K and V may differ)
constexpr uint64_t kPageSize = 16;   // tokens per page, both sides

int failures = 0;

void check(bool ok, const std::string& what) {
    if (!ok) {
        std::fprintf(stderr, "plan_copy: FAILED: %s\n", what.c_str());
        ++failures;
    }
}

void check_status(KvplanStatus status, KvplanStatus expected, const char* what) {
    if (status != expected) {
        std::fprintf(stderr, "plan_copy: FAILED: %s returned %s (%s), expected %s\n", what,
                     kvplan_status_name(status), kvplan_last_error_message(),
                     kvplan_status_name(expected));
        ++failures;
    }
}

// One peer: an arena holding 2 * kLayers entries (K then V), registered in `order`.
struct Peer {
    std::vector<uint8_t> arena;
    std::vector<uint64_t> ptrs, lens, items;
    std::vector<int64_t> ids;
    std::vector<const char*> roles;
    std::vector<uint64_t> offsets;  // entry's offset in the arena, by entry index

    explicit Peer(const std::vector<size_t>& layer_order) {
        uint64_t total = 0;
        for (int half = 0; half < 2; ++half) {
            for (size_t layer : layer_order) {
                const uint64_t item = half == 0 ? kItemK : kItemV;
                offsets.push_back(total);
                items.push_back(item);
                lens.push_back(item * kPages);
                ids.push_back(static_cast<int64_t>(layer));
                roles.push_back(half == 0 ? "k" : "v");
                total += item * kPages;
            }
        }
        arena.assign(total, 0);
        for (uint64_t off : offsets) {
            ptrs.push_back(reinterpret_cast<uint64_t>(arena.data() + off));
        }
    }

    KvplanLayoutDesc desc() const {
        KvplanLayoutDesc d{};
        d.n_entries = ptrs.size();
        d.data_ptrs = ptrs.data();
        d.data_lens = lens.data();
        d.item_lens = items.data();
        d.layer_ids = ids.data();
        d.roles = roles.data();
        d.page_size = kPageSize;
        d.tp_size = 1;
        d.pp_size = 1;
        return d;
    }

    // The entry holding (layer, role).
    size_t entry(int64_t layer, const char* role) const {
        for (size_t e = 0; e < ids.size(); ++e) {
            if (ids[e] == layer && std::strcmp(roles[e], role) == 0) {
                return e;
            }
        }
        std::abort();
    }
};

uint8_t pattern(uint64_t offset) {
    uint64_t x = offset * 0x9E3779B97F4A7C15ULL;
    return static_cast<uint8_t>((x >> 56) ^ (x >> 17) ^ 0x5A);
}

}  // namespace

int main() {
    check(kvplan_abi_version() == KVPLAN_ABI_VERSION, "ABI version of the library");

    std::vector<size_t> forward, backward;
    for (size_t l = 0; l < kLayers; ++l) {
        forward.push_back(l);
        backward.push_back(kLayers - 1 - l);
    }
    Peer prefill(forward), decode(backward);
    for (uint64_t i = 0; i < prefill.arena.size(); ++i) {
        prefill.arena[i] = pattern(i);
    }

    KvplanLayoutDesc src_desc = prefill.desc(), dst_desc = decode.desc();
    KvplanLayout* src = nullptr;
    KvplanLayout* dst = nullptr;
    check_status(kvplan_layout_new(&src_desc, &src), KVPLAN_STATUS_OK, "kvplan_layout_new(src)");
    check_status(kvplan_layout_new(&dst_desc, &dst), KVPLAN_STATUS_OK, "kvplan_layout_new(dst)");
    KvplanTemplate* tmpl = nullptr;
    check_status(kvplan_template_new(src, dst, nullptr, &tmpl), KVPLAN_STATUS_OK,
                 "kvplan_template_new");
    // The template keeps what it needs.
    check_status(kvplan_layout_free(src), KVPLAN_STATUS_OK, "kvplan_layout_free(src)");
    check_status(kvplan_layout_free(dst), KVPLAN_STATUS_OK, "kvplan_layout_free(dst)");
    if (failures != 0) {
        return 1;
    }

    // A fragmented request: runs of 3, 1 and 2 pages, and a descending pair.
    const std::vector<int64_t> src_pages = {0, 1, 2, 7, 20, 21, 30, 29};
    const std::vector<int64_t> dst_pages = {5, 6, 7, 1, 11, 12, 3, 2};
    KvplanRequest request{};
    request.src_pages = src_pages.data();
    request.n_src = src_pages.size();
    request.dst_pages = dst_pages.data();
    request.n_dst = dst_pages.size();
    request.n_tokens = KVPLAN_NO_TOKENS;

    KvplanPlanInfo info{};
    check_status(kvplan_prepare(tmpl, &request, &info), KVPLAN_STATUS_OK, "kvplan_prepare");

    // The caller's buffers, one guard value past each column's end.
    const uint64_t kGuard = 0xDEADBEEFCAFEF00DULL;
    std::vector<uint64_t> src_addrs(info.n_blocks + 1, kGuard);
    std::vector<uint64_t> dst_addrs(info.n_blocks + 1, kGuard);
    std::vector<uint64_t> lengths(info.n_blocks + 1, kGuard);

    // Too small by one: refused, nothing written past what it was given.
    if (info.n_blocks > 0) {
        check_status(kvplan_plan_into(tmpl, &request, src_addrs.data(), dst_addrs.data(),
                                      lengths.data(), info.n_blocks - 1, nullptr),
                     KVPLAN_STATUS_BUFFER_TOO_SMALL, "kvplan_plan_into(capacity - 1)");
        check(src_addrs[info.n_blocks - 1] == kGuard && lengths[info.n_blocks] == kGuard,
              "a too-small buffer is left untouched");
    }

    KvplanPlanInfo planned{};
    check_status(kvplan_plan_into(tmpl, &request, src_addrs.data(), dst_addrs.data(),
                                  lengths.data(), info.n_blocks, &planned),
                 KVPLAN_STATUS_OK, "kvplan_plan_into");
    check(planned.n_blocks == info.n_blocks && planned.total_bytes == info.total_bytes,
          "plan_into reports what prepare did");
    check(src_addrs[info.n_blocks] == kGuard && dst_addrs[info.n_blocks] == kGuard &&
              lengths[info.n_blocks] == kGuard,
          "nothing written past n_blocks");

    // The host-memory copier: one memcpy per block, each checked to lie inside its arena.
    const auto inside = [](const std::vector<uint8_t>& arena, uint64_t addr, uint64_t len) {
        const uint64_t base = reinterpret_cast<uint64_t>(arena.data());
        return addr >= base && len <= arena.size() && addr - base <= arena.size() - len;
    };
    uint64_t moved = 0;
    for (size_t i = 0; i < planned.n_blocks; ++i) {
        if (!inside(prefill.arena, src_addrs[i], lengths[i]) ||
            !inside(decode.arena, dst_addrs[i], lengths[i])) {
            check(false, "block " + std::to_string(i) + " lies outside its arena");
            return 1;
        }
        std::memcpy(reinterpret_cast<void*>(dst_addrs[i]),
                    reinterpret_cast<const void*>(src_addrs[i]), lengths[i]);
        moved += lengths[i];
    }
    check(moved == planned.total_bytes, "bytes moved equal total_bytes");

    // The naive expectation: for every (layer, role) and page pair, the decode page holds the
    // prefill page; every other decode byte is still zero.
    std::vector<uint8_t> expected(decode.arena.size(), 0);
    uint64_t expected_bytes = 0;
    for (size_t layer = 0; layer < kLayers; ++layer) {
        for (const char* role : {"k", "v"}) {
            const size_t se = prefill.entry(static_cast<int64_t>(layer), role);
            const size_t de = decode.entry(static_cast<int64_t>(layer), role);
            const uint64_t item = prefill.items[se];
            for (size_t p = 0; p < src_pages.size(); ++p) {
                const uint64_t from = prefill.offsets[se] + static_cast<uint64_t>(src_pages[p]) * item;
                const uint64_t to = decode.offsets[de] + static_cast<uint64_t>(dst_pages[p]) * item;
                std::memcpy(expected.data() + to, prefill.arena.data() + from, item);
                expected_bytes += item;
            }
        }
    }
    check(expected_bytes == planned.total_bytes, "total_bytes equals the naive count");
    check(decode.arena == expected, "decode arena equals the naive per-page copy");

    // Bad input: an index out of range, a null request, a freed handle.
    const std::vector<int64_t> too_far = {static_cast<int64_t>(kPages)};
    KvplanRequest bad = request;
    bad.src_pages = too_far.data();
    bad.n_src = 1;
    bad.n_dst = 1;
    check_status(kvplan_prepare(tmpl, &bad, &info), KVPLAN_STATUS_INDEX_BOUNDS,
                 "kvplan_prepare(out of range)");
    check(std::strcmp(kvplan_last_error_kind(), "index_bounds") == 0, "the error's kind");
    std::printf("plan_copy: refused as expected: %s\n", kvplan_last_error_message());
    check_status(kvplan_prepare(tmpl, nullptr, &info), KVPLAN_STATUS_NULL_POINTER,
                 "kvplan_prepare(null request)");
    check_status(kvplan_template_free(tmpl), KVPLAN_STATUS_OK, "kvplan_template_free");
    check_status(kvplan_prepare(tmpl, &request, &info), KVPLAN_STATUS_INVALID_HANDLE,
                 "kvplan_prepare(freed template)");

    std::printf("plan_copy: %zu blocks, %llu bytes over %zu runs\n", planned.n_blocks,
                static_cast<unsigned long long>(planned.total_bytes), planned.n_runs);
    if (failures != 0) {
        std::printf("plan_copy: %d checks FAILED\n", failures);
        return 1;
    }
    std::printf("plan_copy: OK\n");
    return 0;
}
