/* The header compiles as strict C11 with every warning an error, and its constants are usable. */
#include "kvplan.h"

int kvplan_header_c11_check(void) {
    KvplanRequest request = {0};
    request.n_tokens = KVPLAN_NO_TOKENS;
    KvplanPlanInfo info = {0};
    KvplanStatus status = kvplan_prepare(NULL, &request, &info);
    return status == KVPLAN_STATUS_NULL_POINTER && kvplan_abi_version() == KVPLAN_ABI_VERSION;
}
