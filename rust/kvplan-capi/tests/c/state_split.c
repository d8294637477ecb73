/* Version 4 of the C ABI from C11: a state entry with a TP channel split (kvplan_layout_new4)
 * planned from prefill TP 1 to decode rank 1 of TP 2 moves the decode rank's share of each
 * shard group in each row, checked against the definition; bad splits are refused with a status
 * and a message. Prints "state_split: OK" when every check passed. */
#include <stdio.h>
#include <string.h>

#include "kvplan.h"

static int failures = 0;

static void check(int ok, const char *what) {
    if (!ok) {
        fprintf(stderr, "state_split: FAILED %s (last error: %s: %s)\n", what,
                kvplan_last_error_kind(), kvplan_last_error_message());
        failures++;
    }
}

/* One state entry of 4 slots: 2 rows of this rank's share of 8 channels of 2 bytes, cut into
 * shard groups {4, 4}. */
static const uint64_t GROUPS[2] = {4, 4};

static KvplanLayoutDesc4 desc4(const uint64_t *ptr, const uint64_t *len, const uint64_t *item,
                               const uint64_t *channels, const uint64_t *rows,
                               const uint8_t *counts, uint32_t tp, uint32_t rank) {
    static const int64_t ids[1] = {0};
    static const uint8_t kinds[1] = {KVPLAN_ENTRY_STATE};
    KvplanLayoutDesc4 d;
    memset(&d, 0, sizeof d);
    d.struct_size = sizeof d;
    d.base.n_entries = 1;
    d.base.data_ptrs = ptr;
    d.base.data_lens = len;
    d.base.item_lens = item;
    d.base.layer_ids = ids;
    d.base.kinds = kinds;
    d.base.page_size = 16;
    d.base.tp_rank = rank;
    d.base.tp_size = tp;
    d.base.pp_size = 1;
    d.state_channels = channels;
    d.state_outer_rows = rows;
    d.shard_group_counts = counts;
    d.shard_groups = GROUPS;
    d.n_shard_groups = 2;
    return d;
}

int main(void) {
    check(kvplan_abi_version() == KVPLAN_ABI_VERSION && KVPLAN_ABI_VERSION >= 4, "ABI version");
    const uint64_t s = 1ull << 40, d = 1ull << 50;
    const uint64_t src_ptr[1] = {s}, src_len[1] = {4 * 32}, src_item[1] = {32}, src_ch[1] = {8};
    const uint64_t dst_ptr[1] = {d}, dst_len[1] = {4 * 16}, dst_item[1] = {16}, dst_ch[1] = {4};
    const uint64_t rows[1] = {2};
    const uint8_t counts[1] = {2};
    KvplanLayoutDesc4 sd = desc4(src_ptr, src_len, src_item, src_ch, rows, counts, 1, 0);
    KvplanLayoutDesc4 dd = desc4(dst_ptr, dst_len, dst_item, dst_ch, rows, counts, 2, 1);
    KvplanLayout *src = NULL, *dst = NULL;
    check(kvplan_layout_new4(&sd, &src) == KVPLAN_STATUS_OK, "prefill layout");
    check(kvplan_layout_new4(&dd, &dst) == KVPLAN_STATUS_OK, "decode layout");
    KvplanTemplate *tmpl = NULL;
    check(kvplan_template_new(src, dst, NULL, &tmpl) == KVPLAN_STATUS_OK, "template");
    kvplan_layout_free(src);
    kvplan_layout_free(dst);

    /* Slot 0 -> slot 1: in each row, channels 2..4 of each group of 4 (bytes 4..8 and 12..16
     * of the prefill's 16-byte row) to the decode's 8-byte row. */
    KvplanRequest2 r;
    memset(&r, 0, sizeof r);
    r.struct_size = sizeof r;
    r.n_tokens = KVPLAN_NO_TOKENS;
    r.src_slot = 0;
    r.dst_slot = 1;
    uint64_t sa[16], da[16], l[16];
    KvplanPlanInfo info;
    check(kvplan_plan_into2(tmpl, &r, sa, da, l, 16, &info) == KVPLAN_STATUS_OK, "slot plan");
    const uint64_t want[4][3] = {
        {s + 4, d + 16, 4}, {s + 12, d + 20, 4}, {s + 20, d + 24, 4}, {s + 28, d + 28, 4}};
    check(info.n_blocks == 4 && info.total_bytes == 16, "four slices of 4 bytes");
    for (size_t i = 0; i < 4 && i < info.n_blocks; i++) {
        check(sa[i] == want[i][0] && da[i] == want[i][1] && l[i] == want[i][2], "a slice");
    }
    kvplan_template_free(tmpl);

    /* A null shard_groups with a non-zero count, and groups that do not sum to the model's
     * channels: refused, no handle. */
    KvplanLayout *bad = NULL;
    KvplanLayoutDesc4 b = sd;
    b.shard_groups = NULL;
    check(kvplan_layout_new4(&b, &bad) == KVPLAN_STATUS_NULL_POINTER && bad == NULL &&
              strstr(kvplan_last_error_message(), "shard_groups") != NULL,
          "null shard_groups refused");
    const uint64_t uneven[2] = {4, 2};
    b = sd;
    b.shard_groups = uneven;
    check(kvplan_layout_new4(&b, &bad) == KVPLAN_STATUS_LAYOUT && bad == NULL &&
              strstr(kvplan_last_error_message(), "[4, 2]") != NULL,
          "groups that do not sum refused");

    if (failures != 0) {
        return 1;
    }
    printf("state_split: OK\n");
    return 0;
}
