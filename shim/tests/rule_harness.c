/*
 * rule_harness.c - runs the C token-spending rule on inputs read from stdin, one per line:
 *   refill <balance> <last_ns> <now_ns> <rate> <burst>   -> "<balance> <last_ns>"
 *   admits <balance> <cost> <burst>                      -> "0" | "1"
 *   spend  <balance> <cost>                              -> "<balance>"
 *   wait   <balance> <cost> <rate> <burst>               -> "<ns>"
 *   cost   <gx> <gy> <gz> <bx> <by> <bz>                 -> "<tokens>"
 * Used by tests/unit/test_shm_layout_rule.py to compare with the Python rule.
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "bucket.h"

int main(void)
{
    char op[16];
    while (scanf("%15s", op) == 1) {
        if (strcmp(op, "refill") == 0) {
            int64_t b, ob;
            uint64_t last, now, rate, burst, ol;
            if (scanf("%" SCNd64 " %" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64, &b, &last, &now,
                      &rate, &burst) != 5)
                return 2;
            vgpu_refill(b, last, now, rate, burst, &ob, &ol);
            printf("%" PRId64 " %" PRIu64 "\n", ob, ol);
        } else if (strcmp(op, "admits") == 0) {
            int64_t b;
            uint64_t cost, burst;
            if (scanf("%" SCNd64 " %" SCNu64 " %" SCNu64, &b, &cost, &burst) != 3)
                return 2;
            printf("%d\n", vgpu_admits(b, cost, burst) ? 1 : 0);
        } else if (strcmp(op, "spend") == 0) {
            int64_t b;
            uint64_t cost;
            if (scanf("%" SCNd64 " %" SCNu64, &b, &cost) != 2)
                return 2;
            printf("%" PRId64 "\n", vgpu_spend(b, cost));
        } else if (strcmp(op, "wait") == 0) {
            int64_t b;
            uint64_t cost, rate, burst;
            if (scanf("%" SCNd64 " %" SCNu64 " %" SCNu64 " %" SCNu64, &b, &cost, &rate, &burst) != 4)
                return 2;
            printf("%" PRIu64 "\n", vgpu_wait_ns_for(b, cost, rate, burst));
        } else if (strcmp(op, "cost") == 0) {
            unsigned d[6];
            if (scanf("%u %u %u %u %u %u", &d[0], &d[1], &d[2], &d[3], &d[4], &d[5]) != 6)
                return 2;
            printf("%" PRIu64 "\n", vgpu_launch_cost(d[0], d[1], d[2], d[3], d[4], d[5]));
        } else {
            return 2;
        }
    }
    return 0;
}
