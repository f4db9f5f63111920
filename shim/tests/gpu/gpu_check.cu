// gpu_check.cu - what the shim does on a real GPU, through the CUDA runtime (which finds the
// driver's entry points with cuGetProcAddress, so this is the path real applications take).
//
//   gpu_check uuid                          prints the UUID of device 0 (GPU-xxxxxxxx-...)
//   gpu_check mem CHUNK_MIB                 cudaMalloc CHUNK_MIB chunks until refused; prints
//                                           "allocated=B refused=CODE meminfo_total=T meminfo_free=F"
//   gpu_check throughput SECONDS GRID BLOCK SPIN_US
//                                           launches a kernel whose blocks spin SPIN_US each for
//                                           SECONDS; prints "launches_per_s=X cost=TOKENS"
//   gpu_check overhead N                    N launches of an empty kernel, host time per launch;
//                                           prints "ns_per_launch=X"
//   gpu_check procaddr                      cudaGetDriverEntryPointByVersion (CUDA 12.8 ABIs) of
//                                           entry points the shim hooks, with the default and the
//                                           per-thread flag; prints "default=H/N per_thread=H/N"
//                                           (H: answered by libvgpu.so)
//   gpu_check graph SECONDS GRID BLOCK SPIN_US N
//                                           captures N spin kernels into a graph (stream capture),
//                                           then launches the graph for SECONDS; prints
//                                           "kernels_per_s=X cost=TOKENS capture_ms=C"
//   gpu_check ctxmem                        cudaMemGetInfo right after the context exists;
//                                           prints "used=B total=T free=F"
//   gpu_check pool CHUNK_MIB MAX_MIB        cudaMallocAsync until refused (at most MAX_MIB), frees
//                                           into the pool, then cudaMallocFromPoolAsync from a new
//                                           pool until refused; prints "async=B refused=CODE
//                                           second=B held=R" (R: the default pool's reserve)
//   gpu_check spill CHUNK_MIB TOTAL_MIB PASSES
//                                           cudaMalloc TOTAL_MIB in chunks (past the card the shim
//                                           serves managed memory), cudaMemGetInfo, a kernel that
//                                           increments every word PASSES times over all of it, then
//                                           the same kernel over device memory only; prints
//                                           "allocated=B managed_chunks=N meminfo_total=T
//                                           meminfo_free=F spill_gbps=X device_gbps=Y correct=0|1"
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define CHECK(call)                                                                               \
    do {                                                                                          \
        cudaError_t e_ = (call);                                                                  \
        if (e_ != cudaSuccess) {                                                                  \
            std::fprintf(stderr, "%s: %s\n", #call, cudaGetErrorString(e_));                      \
            std::exit(1);                                                                         \
        }                                                                                         \
    } while (0)

__global__ void spin(unsigned long long ns)
{
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}

__global__ void empty() {}

static double seconds_since(std::chrono::steady_clock::time_point t0)
{
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

__global__ void touch(unsigned *p, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        p[i] += 1;
}

// PASSES rounds of `touch` over every chunk; GB/s counts each word read and written once a pass.
static double touch_gbps(const std::vector<void *> &chunks, size_t chunk, int passes)
{
    auto t0 = std::chrono::steady_clock::now();
    for (int pass = 0; pass < passes; pass++)
        for (void *p : chunks)
            touch<<<1024, 256>>>(static_cast<unsigned *>(p), chunk / sizeof(unsigned));
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaGetLastError());
    return 2.0 * (double)chunk * (double)chunks.size() * passes / seconds_since(t0) / 1e9;
}

// The first and last word of every chunk read back (a copy from either kind of memory).
static bool all_equal(const std::vector<void *> &chunks, size_t chunk, unsigned want)
{
    for (void *p : chunks) {
        unsigned first = 0, last = 0;
        char *base = static_cast<char *>(p);
        CHECK(cudaMemcpy(&first, base, sizeof first, cudaMemcpyDeviceToHost));
        CHECK(cudaMemcpy(&last, base + chunk - sizeof last, sizeof last, cudaMemcpyDeviceToHost));
        if (first != want || last != want)
            return false;
    }
    return true;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        std::fprintf(stderr, "usage: gpu_check uuid|mem|throughput|overhead ...\n");
        return 2;
    }
    CHECK(cudaSetDevice(0));
    CHECK(cudaFree(0)); // create the context
    if (std::strcmp(argv[1], "uuid") == 0) {
        cudaDeviceProp prop;
        CHECK(cudaGetDeviceProperties(&prop, 0));
        const unsigned char *b = reinterpret_cast<const unsigned char *>(prop.uuid.bytes);
        std::printf("GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x\n",
                    b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11],
                    b[12], b[13], b[14], b[15]);
        return 0;
    }
    if (std::strcmp(argv[1], "mem") == 0 && argc == 3) {
        size_t chunk = std::strtoull(argv[2], nullptr, 10) << 20;
        std::vector<void *> held;
        size_t allocated = 0;
        cudaError_t refused = cudaSuccess;
        for (;;) {
            void *p = nullptr;
            refused = cudaMalloc(&p, chunk);
            if (refused != cudaSuccess)
                break;
            held.push_back(p);
            allocated += chunk;
        }
        cudaGetLastError(); // clear the sticky-free error state of the refusal
        size_t free_b = 0, total_b = 0;
        CHECK(cudaMemGetInfo(&free_b, &total_b));
        std::printf("allocated=%zu refused=%d meminfo_total=%zu meminfo_free=%zu\n", allocated,
                    (int)refused, total_b, free_b);
        for (void *p : held)
            CHECK(cudaFree(p));
        return 0;
    }
    if (std::strcmp(argv[1], "throughput") == 0 && argc == 6) {
        double seconds = std::atof(argv[2]);
        unsigned grid = (unsigned)std::atoi(argv[3]), block = (unsigned)std::atoi(argv[4]);
        unsigned long long spin_ns = std::strtoull(argv[5], nullptr, 10) * 1000ull;
        spin<<<grid, block>>>(spin_ns); // warm up
        CHECK(cudaDeviceSynchronize());
        auto t0 = std::chrono::steady_clock::now();
        unsigned long long launches = 0;
        while (seconds_since(t0) < seconds) {
            spin<<<grid, block>>>(spin_ns);
            launches++;
        }
        CHECK(cudaDeviceSynchronize());
        CHECK(cudaGetLastError());
        std::printf("launches_per_s=%.1f cost=%llu\n", launches / seconds_since(t0),
                    (unsigned long long)grid * block);
        return 0;
    }
    if (std::strcmp(argv[1], "overhead") == 0 && argc == 3) {
        long n = std::atol(argv[2]);
        for (int i = 0; i < 1000; i++)
            empty<<<1, 32>>>();
        CHECK(cudaDeviceSynchronize());
        // batches of 256 so the launch queue never fills and only host-side time is measured
        double host = 0;
        for (long done = 0; done < n; done += 256) {
            auto t0 = std::chrono::steady_clock::now();
            for (int i = 0; i < 256; i++)
                empty<<<1, 32>>>();
            host += seconds_since(t0);
            CHECK(cudaDeviceSynchronize());
        }
        CHECK(cudaGetLastError());
        std::printf("ns_per_launch=%.1f\n", host * 1e9 / (double)((n + 255) / 256 * 256));
        return 0;
    }
    if (std::strcmp(argv[1], "procaddr") == 0 && argc == 2) {
        // entry points the shim hooks, by base name (their 12.8 ABI is the one hooked)
        static const char *const names[] = {
            "cuMemAlloc",        "cuMemFree",          "cuMemGetInfo",         "cuMemAllocAsync",
            "cuMemFreeAsync",    "cuLaunchKernel",     "cuLaunchKernelEx",     "cuGraphLaunch",
            "cuGraphInstantiateWithFlags", "cuGraphExecUpdate", "cuStreamBeginCapture",
            "cuDeviceTotalMem", "cuMemCreate", "cuMemRelease"};
        const unsigned long long flags[2] = {cudaEnableDefault, cudaEnablePerThreadDefaultStream};
        int hooked[2] = {0, 0};
        const int n = (int)(sizeof names / sizeof names[0]);
        for (int f = 0; f < 2; f++)
            for (int i = 0; i < n; i++) {
                void *p = nullptr;
                cudaDriverEntryPointQueryResult q;
                Dl_info info;
                if (cudaGetDriverEntryPointByVersion(names[i], &p, 12080, flags[f], &q) ==
                        cudaSuccess &&
                    p != nullptr && dladdr(p, &info) != 0 && info.dli_fname != nullptr &&
                    std::strstr(info.dli_fname, "libvgpu") != nullptr)
                    hooked[f]++;
                else if (getenv("LD_PRELOAD") != nullptr)
                    std::fprintf(stderr, "not hooked: %s (flag %llu)\n", names[i], flags[f]);
            }
        std::printf("default=%d/%d per_thread=%d/%d\n", hooked[0], n, hooked[1], n);
        return 0;
    }
    if (std::strcmp(argv[1], "graph") == 0 && argc == 7) {
        double seconds = std::atof(argv[2]);
        unsigned grid = (unsigned)std::atoi(argv[3]), block = (unsigned)std::atoi(argv[4]);
        unsigned long long spin_ns = std::strtoull(argv[5], nullptr, 10) * 1000ull;
        int n = std::atoi(argv[6]);
        cudaStream_t s;
        CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        cudaGraph_t g;
        cudaGraphExec_t e;
        auto c0 = std::chrono::steady_clock::now();
        CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
        for (int i = 0; i < n; i++)
            spin<<<grid, block, 0, s>>>(spin_ns);
        CHECK(cudaStreamEndCapture(s, &g));
        double capture_ms = seconds_since(c0) * 1e3;
        CHECK(cudaGraphInstantiate(&e, g, 0));
        CHECK(cudaGraphLaunch(e, s)); // warm up
        CHECK(cudaStreamSynchronize(s));
        auto t0 = std::chrono::steady_clock::now();
        unsigned long long launches = 0;
        while (seconds_since(t0) < seconds) {
            CHECK(cudaGraphLaunch(e, s));
            launches++;
            if (launches % 8 == 0)
                CHECK(cudaStreamSynchronize(s)); // keep the queue short: time is GPU time
        }
        CHECK(cudaStreamSynchronize(s));
        std::printf("kernels_per_s=%.1f cost=%llu capture_ms=%.2f\n",
                    (double)launches * n / seconds_since(t0), (unsigned long long)grid * block,
                    capture_ms);
        CHECK(cudaGraphExecDestroy(e));
        CHECK(cudaGraphDestroy(g));
        return 0;
    }
    if (std::strcmp(argv[1], "ctxmem") == 0 && argc == 2) {
        size_t free_b = 0, total_b = 0;
        CHECK(cudaMemGetInfo(&free_b, &total_b));
        std::printf("used=%zu total=%zu free=%zu\n", total_b - free_b, total_b, free_b);
        return 0;
    }
    if (std::strcmp(argv[1], "pool") == 0 && argc == 4) {
        size_t chunk = std::strtoull(argv[2], nullptr, 10) << 20;
        size_t most = std::strtoull(argv[3], nullptr, 10) << 20;
        cudaStream_t stream;
        CHECK(cudaStreamCreate(&stream));
        std::vector<void *> held;
        size_t async = 0, second = 0;
        cudaError_t refused = cudaSuccess;
        while (async + chunk <= most) {
            void *p = nullptr;
            refused = cudaMallocAsync(&p, chunk, stream);
            if (refused != cudaSuccess)
                break;
            held.push_back(p);
            async += chunk;
        }
        cudaGetLastError();
        for (void *p : held)
            CHECK(cudaFreeAsync(p, stream));
        held.clear();
        // the default pool keeps what was freed into it: a second pool may not add to it
        cudaMemPool_t pool;
        cudaMemPoolProps props = {};
        props.allocType = cudaMemAllocationTypePinned;
        props.location.type = cudaMemLocationTypeDevice;
        props.location.id = 0;
        CHECK(cudaMemPoolCreate(&pool, &props));
        while (second + chunk <= most) {
            void *p = nullptr;
            if (cudaMallocFromPoolAsync(&p, chunk, pool, stream) != cudaSuccess)
                break;
            held.push_back(p);
            second += chunk;
        }
        cudaGetLastError();
        cudaMemPool_t dflt;
        CHECK(cudaDeviceGetDefaultMemPool(&dflt, 0));
        unsigned long long reserved = 0; // the attribute is a 64-bit value
        CHECK(cudaMemPoolGetAttribute(dflt, cudaMemPoolAttrReservedMemCurrent, &reserved));
        for (void *p : held)
            CHECK(cudaFreeAsync(p, stream));
        CHECK(cudaStreamSynchronize(stream));
        CHECK(cudaMemPoolDestroy(pool));
        std::printf("async=%zu refused=%d second=%zu held=%llu\n", async, (int)refused, second,
                    (unsigned long long)reserved);
        return 0;
    }
    if (std::strcmp(argv[1], "spill") == 0 && argc == 5) {
        size_t chunk = std::strtoull(argv[2], nullptr, 10) << 20;
        size_t total = std::strtoull(argv[3], nullptr, 10) << 20;
        int passes = std::atoi(argv[4]);
        std::vector<void *> held;
        size_t allocated = 0, managed = 0;
        while (allocated + chunk <= total) {
            void *p = nullptr;
            if (cudaMalloc(&p, chunk) != cudaSuccess)
                break;
            cudaPointerAttributes attr;
            CHECK(cudaPointerGetAttributes(&attr, p));
            managed += attr.type == cudaMemoryTypeManaged;
            CHECK(cudaMemset(p, 0, chunk));
            held.push_back(p);
            allocated += chunk;
        }
        cudaGetLastError();
        size_t free_b = 0, total_b = 0;
        CHECK(cudaMemGetInfo(&free_b, &total_b));
        double spill_gbps = touch_gbps(held, chunk, passes);
        bool correct = all_equal(held, chunk, (unsigned)passes);
        for (void *p : held)
            CHECK(cudaFree(p));
        // the same kernel over device memory: as many chunks as a quarter of the total
        std::vector<void *> device;
        for (size_t i = 0; i < held.size() / 4 + 1; i++) {
            void *p = nullptr;
            CHECK(cudaMalloc(&p, chunk));
            CHECK(cudaMemset(p, 0, chunk));
            device.push_back(p);
        }
        double device_gbps = touch_gbps(device, chunk, passes);
        correct = correct && all_equal(device, chunk, (unsigned)passes);
        for (void *p : device)
            CHECK(cudaFree(p));
        std::printf("allocated=%zu managed_chunks=%zu meminfo_total=%zu meminfo_free=%zu "
                    "spill_gbps=%.1f device_gbps=%.1f correct=%d\n",
                    allocated, managed, total_b, free_b, spill_gbps, device_gbps, (int)correct);
        return 0;
    }
    std::fprintf(stderr, "bad arguments\n");
    return 2;
}
