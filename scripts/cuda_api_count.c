/*
 * Counts a process's CUDA driver calls by kind, for scripts/gpu_check.sh:
 * how many host-to-device and device-to-host copies a training step makes.
 *
 * Loaded with LD_PRELOAD, it subscribes to CUPTI's driver-API callbacks
 * before the program starts (so it sees every call, however the program
 * loads libcuda: cudarc opens it with dlopen, where symbol interposition
 * would see nothing) and, at exit, appends one line of counts to the file
 * named by CUDA_API_COUNT_OUT (standard error without it):
 *
 *   h2d=N d2h=N d2d=N copy=N memset=N launch=N sync=N alloc=N free=N
 *
 * copy: copies whose direction the call does not name (cuMemcpy and
 * cuMemcpyAsync on unified addresses, 2D and 3D copies). A per-step count
 * is the difference of two runs that differ only in their number of steps.
 *
 * Build (the headers and libcupti come with the nvidia-cuda-cupti wheel):
 *   gcc -shared -fPIC -O2 -I$NV/cu13/include -o libcuda_api_count.so \
 *       scripts/cuda_api_count.c -L$NV/cu13/lib -l:libcupti.so.13
 */
#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { H2D, D2H, D2D, COPY, MEMSET, LAUNCH, SYNC, ALLOC, FREE, KINDS };
static const char *const NAMES[KINDS] = {"h2d",    "d2h",  "d2d",   "copy", "memset",
                                         "launch", "sync", "alloc", "free"};
static unsigned long counts[KINDS];
static CUpti_SubscriberHandle subscriber;
static int subscribed;

static int kind_of(const char *f) {
    if (strstr(f, "HtoD")) return H2D;
    if (strstr(f, "DtoH")) return D2H;
    if (strstr(f, "DtoD") || strstr(f, "Peer")) return D2D;
    if (strncmp(f, "cuMemcpy", 8) == 0) return COPY;
    if (strncmp(f, "cuMemset", 8) == 0) return MEMSET;
    if (strncmp(f, "cuLaunch", 8) == 0) return LAUNCH;
    if (strstr(f, "Synchronize")) return SYNC;
    if (strncmp(f, "cuMemAlloc", 10) == 0) return ALLOC;
    if (strncmp(f, "cuMemFree", 9) == 0) return FREE;
    return -1;
}

static void CUPTIAPI on_call(void *userdata, CUpti_CallbackDomain domain, CUpti_CallbackId id,
                             const void *data) {
    (void)userdata;
    (void)id;
    const CUpti_CallbackData *call = data;
    if (domain != CUPTI_CB_DOMAIN_DRIVER_API || call->callbackSite != CUPTI_API_ENTER) return;
    int kind = call->functionName ? kind_of(call->functionName) : -1;
    if (kind >= 0) __atomic_fetch_add(&counts[kind], 1, __ATOMIC_RELAXED);
}

__attribute__((constructor)) static void start(void) {
    if (cuptiSubscribe(&subscriber, on_call, NULL) != CUPTI_SUCCESS ||
        cuptiEnableDomain(1, subscriber, CUPTI_CB_DOMAIN_DRIVER_API) != CUPTI_SUCCESS) {
        fprintf(stderr, "cuda_api_count: CUPTI refused the subscription: nothing counted\n");
        return;
    }
    subscribed = 1;
}

__attribute__((destructor)) static void report(void) {
    if (!subscribed) return;
    const char *path = getenv("CUDA_API_COUNT_OUT");
    FILE *out = path ? fopen(path, "a") : NULL;
    FILE *to = out ? out : stderr;
    for (int k = 0; k < KINDS; k++)
        fprintf(to, "%s%s=%lu", k ? " " : "", NAMES[k],
                __atomic_load_n(&counts[k], __ATOMIC_RELAXED));
    fputc('\n', to);
    if (out) fclose(out);
}
