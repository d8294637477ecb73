/* Version 2 of the C ABI from C11: a layout with a state entry and a ring (kvplan_layout_new2),
 * a slot request with ring positions (kvplan_plan_into2) checked against the definition, a
 * version 1 page request planned as the same version 2 request, pages with slots planned as the
 * pages and then the slots, and malformed requests refused with a status and a message. Prints
 * "request2: OK" when every check passed. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvplan.h"

enum { ENTRIES = 4, SLOTS = 3, ROW = 64, STATE = 128, PAGE = 256, PAGES = 16 };

static int failures = 0;

static void check(int ok, const char *what) {
    if (!ok) {
        fprintf(stderr, "request2: FAILED %s (last error: %s: %s)\n", what, kvplan_last_error_kind(),
                kvplan_last_error_message());
        failures++;
    }
}

/* One peer: KV of layer 0 (k, v), a plain state entry and a ring of `ring` rows per slot. */
static KvplanLayout *peer(uint64_t base, uint64_t ring) {
    const uint64_t ptrs[ENTRIES] = {base, base + (1ull << 32), base + (2ull << 32), base + (3ull << 32)};
    const uint64_t lens[ENTRIES] = {PAGE * PAGES, PAGE * PAGES, STATE * SLOTS, ROW * SLOTS * ring};
    const uint64_t items[ENTRIES] = {PAGE, PAGE, STATE, ROW};
    const int64_t ids[ENTRIES] = {0, 0, 0, 0};
    const char *roles[ENTRIES] = {"k", "v", "conv", "ring"};
    const uint8_t kinds[ENTRIES] = {KVPLAN_ENTRY_PAGE, KVPLAN_ENTRY_PAGE, KVPLAN_ENTRY_STATE,
                                    KVPLAN_ENTRY_STATE};
    const uint64_t rings[ENTRIES] = {0, 0, 0, ring};
    KvplanLayoutDesc2 desc;
    memset(&desc, 0, sizeof desc);
    desc.struct_size = sizeof desc;
    desc.base.n_entries = ENTRIES;
    desc.base.data_ptrs = ptrs;
    desc.base.data_lens = lens;
    desc.base.item_lens = items;
    desc.base.layer_ids = ids;
    desc.base.roles = roles;
    desc.base.kinds = kinds;
    desc.base.page_size = 16;
    desc.base.tp_size = 1;
    desc.base.pp_size = 1;
    desc.rings = rings;
    KvplanLayout *layout = NULL;
    check(kvplan_layout_new2(&desc, &layout) == KVPLAN_STATUS_OK, "kvplan_layout_new2");
    return layout;
}

static KvplanRequest2 request2(void) {
    KvplanRequest2 r;
    memset(&r, 0, sizeof r);
    r.struct_size = sizeof r;
    r.n_tokens = KVPLAN_NO_TOKENS;
    r.src_slot = KVPLAN_NO_SLOT;
    r.dst_slot = KVPLAN_NO_SLOT;
    return r;
}

int main(void) {
    const uint64_t src_base = 1ull << 40, dst_base = 1ull << 50;
    check(kvplan_abi_version() == KVPLAN_ABI_VERSION && KVPLAN_ABI_VERSION >= 2, "ABI version");
    KvplanLayout *src = peer(src_base, 2), *dst = peer(dst_base, 4);
    KvplanTemplate *tmpl = NULL;
    check(kvplan_template_new(src, dst, NULL, &tmpl) == KVPLAN_STATUS_OK, "kvplan_template_new");
    kvplan_layout_free(src);
    kvplan_layout_free(dst);

    uint64_t s[16], d[16], l[16];
    KvplanPlanInfo info;

    /* Slot 1 -> slot 2 after 3 positions: the plain state slot, then the ring rows of the
     * last min(2, 4, 3) = 2 positions (2 and 1 on the prefill's ring of 2, 2 and 1 on the
     * decode's ring of 4). */
    KvplanRequest2 slot = request2();
    slot.src_slot = 1;
    slot.dst_slot = 2;
    slot.n_tokens = 3;
    check(kvplan_plan_into2(tmpl, &slot, s, d, l, 16, &info) == KVPLAN_STATUS_OK, "slot plan");
    uint64_t moved = 0;
    for (size_t i = 0; i < info.n_blocks; i++) {
        moved += l[i];
    }
    check(info.n_blocks >= 2 && moved == STATE + 2 * ROW, "slot plan bytes");
    check(s[0] == src_base + (2ull << 32) + STATE * 1 && d[0] == dst_base + (2ull << 32) + STATE * 2 &&
              l[0] == STATE,
          "the plain state slot block");
    /* Position 1 is prefill row 1*2 + 1 % 2 = 3 and decode row 2*4 + 1 % 4 = 9. */
    check(s[1] == src_base + (3ull << 32) + ROW * 3 && d[1] == dst_base + (3ull << 32) + ROW * 9,
          "the first ring row");

    /* A version 1 page request plans what the same version 2 request plans. */
    const int64_t sp[3] = {0, 1, 7}, dp[3] = {4, 5, 2};
    KvplanRequest v1 = {sp, 3, dp, 3, KVPLAN_NO_TOKENS, 0};
    uint64_t s1[16], d1[16], l1[16];
    KvplanPlanInfo info1;
    check(kvplan_plan_into(tmpl, &v1, s1, d1, l1, 16, &info1) == KVPLAN_STATUS_OK, "v1 plan");
    KvplanRequest2 pages = request2();
    pages.src_pages = sp;
    pages.n_src = 3;
    pages.dst_pages = dp;
    pages.n_dst = 3;
    check(kvplan_plan_into2(tmpl, &pages, s, d, l, 16, &info) == KVPLAN_STATUS_OK, "v2 plan");
    check(info.n_blocks == info1.n_blocks && info.n_blocks == 4 &&
              memcmp(s, s1, info.n_blocks * 8) == 0 && memcmp(d, d1, info.n_blocks * 8) == 0 &&
              memcmp(l, l1, info.n_blocks * 8) == 0,
          "v1 and v2 page plans equal");

    /* Pages with both slots, 40 tokens: a hybrid model's whole request, planned as the page
     * request and then the slot request with the same n_tokens (its ring rows). */
    KvplanRequest2 part = pages;
    part.n_tokens = 40;
    KvplanPlanInfo info_pages, info_state, info_whole;
    check(kvplan_plan_into2(tmpl, &part, s1, d1, l1, 16, &info_pages) == KVPLAN_STATUS_OK,
          "pages of 40 tokens");
    KvplanRequest2 state = slot;
    state.n_tokens = 40;
    check(kvplan_plan_into2(tmpl, &state, s, d, l, 16, &info_state) == KVPLAN_STATUS_OK,
          "slot after 40 tokens");
    KvplanRequest2 whole = part;
    whole.src_slot = 1;
    whole.dst_slot = 2;
    uint64_t sw[32], dw[32], lw[32];
    check(kvplan_plan_into2(tmpl, &whole, sw, dw, lw, 32, &info_whole) == KVPLAN_STATUS_OK,
          "pages with slots");
    const size_t np = info_pages.n_blocks, ns = info_state.n_blocks;
    check(np >= 1 && ns >= 2 && info_whole.n_blocks == np + ns &&
              info_whole.total_bytes == info_pages.total_bytes + info_state.total_bytes &&
              memcmp(sw, s1, np * 8) == 0 && memcmp(dw, d1, np * 8) == 0 &&
              memcmp(lw, l1, np * 8) == 0 && memcmp(sw + np, s, ns * 8) == 0 &&
              memcmp(dw + np, d, ns * 8) == 0 && memcmp(lw + np, l, ns * 8) == 0,
          "pages then slots");

    /* Malformed requests: a status and a message naming the values, nothing planned. */
    KvplanRequest2 bad = slot;
    bad.struct_size = sizeof(KvplanRequest);
    check(kvplan_prepare2(tmpl, &bad, &info) == KVPLAN_STATUS_INVALID_ARGUMENT &&
              strstr(kvplan_last_error_message(), "struct_size") != NULL,
          "a version 1 size refused");
    bad = slot;
    bad.dst_slot = KVPLAN_NO_SLOT;
    check(kvplan_prepare2(tmpl, &bad, &info) == KVPLAN_STATUS_INVALID_ARGUMENT &&
              strstr(kvplan_last_error_message(), "dst_slot is -1") != NULL,
          "one slot only refused");
    bad = pages;
    bad.window_sides = KVPLAN_WINDOW_SRC;
    bad.n_src_window = 2;
    check(kvplan_prepare2(tmpl, &bad, &info) == KVPLAN_STATUS_NULL_POINTER &&
              strstr(kvplan_last_error_message(), "src_window_pages is null") != NULL,
          "null window pages refused");
    check(kvplan_prepare2(tmpl, NULL, &info) == KVPLAN_STATUS_NULL_POINTER, "null request refused");

    kvplan_template_free(tmpl);
    if (failures) {
        return EXIT_FAILURE;
    }
    puts("request2: OK");
    return EXIT_SUCCESS;
}
