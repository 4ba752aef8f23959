/* shimtest: GPU-free tests of libgpuslice against the fake libcuda.so.1 and
 * libnvidia-ml.so.1.
 *
 *   shimtest              run every case, TAP output, exit 1 on any failure
 *   shimtest --list       print the case names
 *   shimtest --run NAME   run one case (in its own environment)
 *
 * Each case runs in a fresh process exec'ed with LD_PRELOAD of the tests' copy
 * of the library (build/test/libgpuslice.so, whose ledger directory is the
 * relative "ledger" and whose limit file the relative "limit"), the fake
 * libraries first on LD_LIBRARY_PATH, the environment the case names, and a
 * working directory of its own ($SHIMTEST_DIR) holding its ledger directory
 * and limit file, so the shim's constructor reads them as in a container.
 * Words of the case's environment that are the harness's, not variables:
 * LIMIT_FILE=v writes "v\n" into the limit file, LIMIT_FILE_BARE=v writes v
 * alone, SHIMTEST_LIMIT_DIR=1 makes "limit" a directory (present, not
 * readable as a file); no such word, no limit file.  A case whose
 * environment names SHIMTEST_NO_LEDGER=1 gets no ledger directory.  Its stderr goes to
 * $SHIMTEST_DIR/stderr (copied to ours at its end), so a case can count what
 * the shim said, constructor included.  Device memory is observed through the shim's own cuMemGetInfo
 * (used = total - free while the limit is below the fake's 80 GiB). */
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cuda_abi.h"

#define MiB (1ULL << 20)
#define GiB (1ULL << 30)

static const char *g_case;
#define CHECK(cond, ...)                                                        \
    do {                                                                        \
        if (!(cond)) {                                                          \
            fprintf(stderr, "  FAIL %s:%d [%s] %s: ", __FILE__, __LINE__, g_case, #cond); \
            fprintf(stderr, __VA_ARGS__);                                       \
            fprintf(stderr, "\n");                                              \
            exit(1);                                                            \
        }                                                                       \
    } while (0)
#define OK(call) CHECK((call) == CUDA_SUCCESS, "%s", #call)

/* ---- the driver as the program sees it --------------------------------- */
static void *hcuda, *hnvml;
static CUresult (*Alloc)(CUdeviceptr *, size_t);
static CUresult (*Free)(CUdeviceptr);
static CUresult (*Pitch)(CUdeviceptr *, size_t *, size_t, size_t, unsigned);
static CUresult (*Managed)(CUdeviceptr *, size_t, unsigned);
static CUresult (*GetInfo)(size_t *, size_t *);
static CUresult (*TotalMem)(size_t *, CUdevice);
static CUresult (*Create)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
static CUresult (*Release)(CUmemGenericAllocationHandle);
static CUresult (*Map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
static CUresult (*Unmap)(CUdeviceptr, size_t);
static CUresult (*Retain)(CUmemGenericAllocationHandle *, void *);
static CUresult (*ArrCreate)(CUarray *, const CUDA_ARRAY_DESCRIPTOR *);
static CUresult (*Arr3DCreate)(CUarray *, const CUDA_ARRAY3D_DESCRIPTOR *);
static CUresult (*ArrDestroy)(CUarray);
static CUresult (*MipCreate)(CUmipmappedArray *, const CUDA_ARRAY3D_DESCRIPTOR *, unsigned);
static CUresult (*MipDestroy)(CUmipmappedArray);
static CUresult (*ArrReq)(CUDA_ARRAY_MEMORY_REQUIREMENTS *, CUarray, CUdevice);
static CUresult (*AllocAsync)(CUdeviceptr *, size_t, CUstream);
static CUresult (*FreeAsync)(CUdeviceptr, CUstream);
static CUresult (*AllocPool)(CUdeviceptr *, size_t, CUmemoryPool, CUstream);
static CUresult (*GPA)(const char *, void **, int, cuuint64_t);
static CUresult (*GPA2)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
static CUresult (*CtxRetain)(CUcontext *, CUdevice);
static CUresult (*PoolCreate)(CUmemoryPool *, const CUmemPoolProps *);
static CUresult (*PoolDestroy)(CUmemoryPool);
static CUresult (*PoolSetAttr)(CUmemoryPool, CUmemPool_attribute, void *);
static CUresult (*DevGetMemPool)(CUmemoryPool *, CUdevice);
static CUresult (*StreamSync)(CUstream);
static CUresult (*GraphCreate)(CUgraph *, unsigned);
static CUresult (*AddAllocNode)(CUgraphNode *, CUgraph, const CUgraphNode *, size_t, CUDA_MEM_ALLOC_NODE_PARAMS *);
static CUresult (*AddFreeNode)(CUgraphNode *, CUgraph, const CUgraphNode *, size_t, CUdeviceptr);
static CUresult (*Instantiate)(CUgraphExec *, CUgraph, unsigned long long);
static CUresult (*Launch)(CUgraphExec, CUstream);
static CUresult (*ExecDestroy)(CUgraphExec);
static CUresult (*GraphMemTrim)(CUdevice);
static CUresult (*BeginCapture)(CUstream, int);
static CUresult (*EndCapture)(CUstream, CUgraph *);
static const char *(*FakeLast)(void);
static void (*FakeSetDevice)(int);
static uint64_t (*FakePhysUsed)(void);
static uint64_t (*FakeDevUsed)(int);
static int (*FakeGrowContext)(int, uint64_t);
static unsigned (*FakeNvmlQueries)(void);
static void (*FakeNvmlSetLag)(unsigned long long);
static void (*FakeShrinkContext)(int, uint64_t);

static uint64_t (*FakeModuleBytes)(void);

static void *sym(void *h, const char *name)
{
    void *p = dlsym(h, name);
    CHECK(p, "dlsym %s: %s", name, dlerror());
    return p;
}

static void open_driver(void)
{
    hcuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    CHECK(hcuda, "dlopen libcuda.so.1: %s", dlerror());
    hnvml = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    CHECK(hnvml, "dlopen libnvidia-ml.so.1: %s", dlerror());
    *(void **)&Alloc = sym(hcuda, "cuMemAlloc_v2");
    *(void **)&Free = sym(hcuda, "cuMemFree_v2");
    *(void **)&Pitch = sym(hcuda, "cuMemAllocPitch_v2");
    *(void **)&Managed = sym(hcuda, "cuMemAllocManaged");
    *(void **)&GetInfo = sym(hcuda, "cuMemGetInfo_v2");
    *(void **)&TotalMem = sym(hcuda, "cuDeviceTotalMem_v2");
    *(void **)&Create = sym(hcuda, "cuMemCreate");
    *(void **)&Release = sym(hcuda, "cuMemRelease");
    *(void **)&Map = sym(hcuda, "cuMemMap");
    *(void **)&Unmap = sym(hcuda, "cuMemUnmap");
    *(void **)&Retain = sym(hcuda, "cuMemRetainAllocationHandle");
    *(void **)&ArrCreate = sym(hcuda, "cuArrayCreate_v2");
    *(void **)&Arr3DCreate = sym(hcuda, "cuArray3DCreate_v2");
    *(void **)&ArrDestroy = sym(hcuda, "cuArrayDestroy");
    *(void **)&MipCreate = sym(hcuda, "cuMipmappedArrayCreate");
    *(void **)&MipDestroy = sym(hcuda, "cuMipmappedArrayDestroy");
    *(void **)&ArrReq = sym(hcuda, "cuArrayGetMemoryRequirements");
    *(void **)&AllocAsync = sym(hcuda, "cuMemAllocAsync");
    *(void **)&FreeAsync = sym(hcuda, "cuMemFreeAsync");
    *(void **)&AllocPool = sym(hcuda, "cuMemAllocFromPoolAsync");
    *(void **)&GPA = sym(hcuda, "cuGetProcAddress");
    *(void **)&GPA2 = sym(hcuda, "cuGetProcAddress_v2");
    *(void **)&FakeLast = sym(hcuda, "fake_last");
    *(void **)&FakeSetDevice = sym(hcuda, "fake_set_device");
    *(void **)&FakePhysUsed = sym(hcuda, "fake_phys_used");
    *(void **)&FakeDevUsed = sym(hcuda, "fake_dev_used");
    *(void **)&FakeGrowContext = sym(hcuda, "fake_grow_context");
    *(void **)&FakeNvmlQueries = sym(hnvml, "fake_nvml_proc_queries");
    *(void **)&FakeNvmlSetLag = sym(hnvml, "fake_nvml_set_lag");
    *(void **)&FakeShrinkContext = sym(hcuda, "fake_shrink_context");
    *(void **)&FakeModuleBytes = sym(hcuda, "fake_module_bytes");
    *(void **)&CtxRetain = sym(hcuda, "cuDevicePrimaryCtxRetain");
    *(void **)&PoolCreate = sym(hcuda, "cuMemPoolCreate");
    *(void **)&PoolDestroy = sym(hcuda, "cuMemPoolDestroy");
    *(void **)&PoolSetAttr = sym(hcuda, "cuMemPoolSetAttribute");
    *(void **)&DevGetMemPool = sym(hcuda, "cuDeviceGetMemPool");
    *(void **)&StreamSync = sym(hcuda, "cuStreamSynchronize");
    *(void **)&GraphCreate = sym(hcuda, "cuGraphCreate");
    *(void **)&AddAllocNode = sym(hcuda, "cuGraphAddMemAllocNode");
    *(void **)&AddFreeNode = sym(hcuda, "cuGraphAddMemFreeNode");
    *(void **)&Instantiate = sym(hcuda, "cuGraphInstantiateWithFlags");
    *(void **)&Launch = sym(hcuda, "cuGraphLaunch");
    *(void **)&ExecDestroy = sym(hcuda, "cuGraphExecDestroy");
    *(void **)&GraphMemTrim = sym(hcuda, "cuDeviceGraphMemTrim");
    *(void **)&BeginCapture = sym(hcuda, "cuStreamBeginCapture_v2");
    *(void **)&EndCapture = sym(hcuda, "cuStreamEndCapture");
    CUresult (*init)(unsigned) = (CUresult(*)(unsigned))sym(hcuda, "cuInit");
    OK(init(0));
}

/* what the case's limit file holds, as written (NULL: no such file) */
static const char *limit_file(void)
{
    static char buf[128];
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/limit", getenv("SHIMTEST_DIR"));
    FILE *fp = fopen(path, "r");
    if (!fp) return NULL;
    size_t n = fread(buf, 1, sizeof buf - 1, fp);
    fclose(fp);
    buf[n] = 0;
    return buf;
}

/* the case's limit in bytes, read here from its file (0: none) */
static uint64_t slice_limit(void)
{
    const char *v = limit_file();
    return v ? strtoull(v, NULL, 10) : 0;
}

/* bytes the slice holds, as the shim reports them */
static uint64_t used(void)
{
    size_t f, t;
    OK(GetInfo(&f, &t));
    CHECK(f <= t, "free %zu > total %zu", f, t);
    return t - f;
}

/* times `needle` occurs in what this case's processes wrote to stderr */
static int stderr_count(const char *needle)
{
    char path[PATH_MAX], buf[1 << 16];
    snprintf(path, sizeof path, "%s/stderr", getenv("SHIMTEST_DIR"));
    FILE *fp = fopen(path, "r");
    CHECK(fp, "open %s", path);
    size_t n = fread(buf, 1, sizeof buf - 1, fp);
    fclose(fp);
    buf[n] = 0;
    int count = 0;
    for (const char *p = buf; (p = strstr(p, needle)); p += strlen(needle)) count++;
    return count;
}

static const char *lib_of(void *p, const char **symname)
{
    static char buf[PATH_MAX];
    Dl_info i;
    if (!p || !dladdr(p, &i) || !i.dli_fname) return "?";
    snprintf(buf, sizeof buf, "%s", strrchr(i.dli_fname, '/') ? strrchr(i.dli_fname, '/') + 1 : i.dli_fname);
    if (symname) *symname = i.dli_sname ? i.dli_sname : "?";
    return buf;
}
static int in_shim(void *p) { return strstr(lib_of(p, NULL), "libgpuslice") != NULL; }
static int in_fake(void *p) { return strstr(lib_of(p, NULL), "libcuda.so") != NULL; }

static void retain(int dev);

/* ====================================================================== */
static void case_passthrough(void)
{
    open_driver();
    CHECK(in_fake((void *)Alloc), "no limit: dlsym must give the driver's own cuMemAlloc_v2, got %s",
          lib_of((void *)Alloc, NULL));
    CHECK(in_fake((void *)GetInfo), "cuMemGetInfo_v2 from %s", lib_of((void *)GetInfo, NULL));
    /* and the exported path, as a program linked with -lcuda calls it */
    CUresult (*linked)(CUdeviceptr *, size_t) = dlsym(RTLD_DEFAULT, "cuMemAlloc_v2");
    CHECK(in_shim((void *)linked), "preloaded shim must come first");
    CUdeviceptr p;
    OK(linked(&p, 50 * GiB));
    size_t f, t;
    CUresult (*linfo)(size_t *, size_t *) = dlsym(RTLD_DEFAULT, "cuMemGetInfo_v2");
    OK(linfo(&f, &t));
    CHECK(t == 80 * GiB && f == 30 * GiB, "pass-through must report the driver's figures: %zu/%zu", f, t);
    void *fn = NULL;
    OK(GPA("cuMemAlloc", &fn, 12000, 0));
    CHECK(in_fake(fn), "no limit: cuGetProcAddress must give the driver's pointer");
    CHECK(stderr_count("libgpuslice") == 0, "pass-through says nothing");
}

/* Every allocation of device memory is refused before it reaches the
 * driver, the figures show an empty slice (total 0, free 0), and the shim
 * says `said` once and nothing else.  Never "no limit". */
static void expect_refused(const char *said)
{
    open_driver();
    retain(0); /* with FAKE_CTX_BYTES: a context the driver holds, counted */
    CHECK(in_shim((void *)Alloc), "a refused limit is enforced, not passed through: dlsym gave %s",
          lib_of((void *)Alloc, NULL));
    CUdeviceptr p;
    size_t pitch;
    CHECK(Alloc(&p, 1) == CUDA_ERROR_OUT_OF_MEMORY, "one byte is refused");
    CHECK(Alloc(&p, 16 * MiB) == CUDA_ERROR_OUT_OF_MEMORY, "16 MiB is refused");
    CHECK(Pitch(&p, &pitch, 512, 1, 4) == CUDA_ERROR_OUT_OF_MEMORY, "pitched is refused");
    CHECK(Managed(&p, 4096, 1) == CUDA_ERROR_OUT_OF_MEMORY, "managed is refused");
    CHECK(AllocAsync(&p, 2 * MiB, NULL) == CUDA_ERROR_OUT_OF_MEMORY, "stream-ordered is refused");
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    CUmemGenericAllocationHandle h;
    CHECK(Create(&h, 2 * MiB, &prop, 0) == CUDA_ERROR_OUT_OF_MEMORY, "VMM on the device is refused");
    CUDA_ARRAY_DESCRIPTOR d2 = {.Width = 16, .Height = 16, .Format = CU_AD_FORMAT_FLOAT, .NumChannels = 1};
    CUarray arr;
    CHECK(ArrCreate(&arr, &d2) == CUDA_ERROR_OUT_OF_MEMORY, "an array is refused");
    uint64_t ctx = FakeDevUsed(0);
    CHECK(FakePhysUsed() == ctx, "nothing but the context reached the driver: %llu bytes",
          (unsigned long long)(FakePhysUsed() - ctx));
    prop.location.type = CU_MEM_LOCATION_TYPE_HOST;
    OK(Create(&h, 2 * MiB, &prop, 0)); /* host memory is not the slice's to refuse */
    OK(Release(h));
    size_t f = 1, t = 1, tm = 1;
    OK(GetInfo(&f, &t));
    CHECK(t == 0 && f == 0, "cuMemGetInfo: total %zu free %zu, want 0 and 0", t, f);
    OK(TotalMem(&tm, 0));
    CHECK(tm == 0, "cuDeviceTotalMem: %zu, want 0", tm);
    nvmlReturn_t (*init)(void) = (nvmlReturn_t(*)(void))sym(hnvml, "nvmlInit_v2");
    nvmlReturn_t (*byidx)(unsigned, nvmlDevice_t *) = (nvmlReturn_t(*)(unsigned, nvmlDevice_t *))sym(hnvml, "nvmlDeviceGetHandleByIndex_v2");
    nvmlReturn_t (*m1)(nvmlDevice_t, nvmlMemory_t *) = (nvmlReturn_t(*)(nvmlDevice_t, nvmlMemory_t *))sym(hnvml, "nvmlDeviceGetMemoryInfo");
    nvmlDevice_t dev;
    nvmlMemory_t m;
    CHECK(init() == NVML_SUCCESS && byidx(0, &dev) == NVML_SUCCESS && m1(dev, &m) == NVML_SUCCESS, "nvml");
    CHECK(m.total == 0 && m.free == 0 && m.used == 0, "NVML: total %llu free %llu used %llu, want 0",
          m.total, m.free, m.used);
    CHECK(stderr_count(said) == 1, "the shim must say once: %s", said);
    CHECK(stderr_count("libgpuslice") == 1, "and nothing else (no second line about the context)");
}

/* A limit file that is not a byte count >= 1: refused, the shim naming the
 * file, what it holds and why. */
static void case_refused(void)
{
    const char *raw = limit_file();
    CHECK(raw, "case runs with a limit file");
    /* why the content is refused, worked out here independently of the shim */
    char v[128];
    snprintf(v, sizeof v, "%s", raw);
    size_t n = strlen(v);
    /* a byte count has at most 20 digits: the shim reads 31 bytes and shows them */
    int longer = n > 30;
    if (longer) v[31] = 0;
    else if (n && v[n - 1] == '\n') v[--n] = 0;
    int digits = *v != 0, nonzero = 0;
    for (const char *q = v; *q; q++) {
        digits &= *q >= '0' && *q <= '9';
        nonzero |= *q > '0' && *q <= '9';
    }
    const char *why = longer ? "is longer than any byte count" : !*v ? "is empty"
                    : !digits ? "is not a plain decimal byte count"
                    : nonzero ? "is beyond 18446744073709551615" : "is zero";
    for (char *q = v; *q; q++) /* the shim shows other bytes than printable ASCII as '?' */
        if (*q < 0x20 || *q > 0x7e) *q = '?';
    char said[400];
    snprintf(said, sizeof said, "warning: the slice's limit file limit holds \"%s\", which %s (a limit "
             "is a byte count such as 1073741824 for 1 GiB): every allocation of device memory is refused",
             v, why);
    expect_refused(said);
}

/* CDMO_GPU_MEMORY_LIMIT says this is a slice, but its limit file is absent:
 * refused, never the variable's value and never "no limit". */
static void case_refused_no_file(void)
{
    CHECK(!limit_file() && getenv("CDMO_GPU_MEMORY_LIMIT"), "case runs with the variable and no file");
    expect_refused("warning: CDMO_GPU_MEMORY_LIMIT is set but the slice's limit file limit is absent "
                   "(the variable is for display only): every allocation of device memory is refused");
}

/* A limit file that is there but cannot be read as one (a directory). */
static void case_refused_unreadable(void)
{
    struct stat st;
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/limit", getenv("SHIMTEST_DIR"));
    CHECK(stat(path, &st) == 0 && S_ISDIR(st.st_mode), "case runs with a directory for the limit file");
    expect_refused("warning: the slice's limit file limit cannot be read (not a regular file): every "
                   "allocation of device memory is refused");
}

/* A valid limit holds at exactly its byte count, one byte either side,
 * whatever CDMO_GPU_MEMORY_LIMIT says. */
static void case_limit_exact(void)
{
    CHECK(slice_limit() == 1073741824ULL, "case runs with a limit file of 1073741824");
    open_driver();
    CUdeviceptr a, b, c;
    CHECK(Alloc(&a, 1 * GiB + 1) == CUDA_ERROR_OUT_OF_MEMORY, "limit + 1 byte is refused");
    OK(Alloc(&a, 1 * GiB)); /* the limit itself fits */
    CHECK(Alloc(&b, 1) == CUDA_ERROR_OUT_OF_MEMORY, "full: one more byte is refused");
    OK(Free(a));
    OK(Alloc(&a, 1 * GiB - 1));
    OK(Alloc(&b, 1)); /* limit - 1, then the last byte */
    CHECK(Alloc(&c, 1) == CUDA_ERROR_OUT_OF_MEMORY, "and not one byte more");
    CHECK(used() == 1 * GiB, "used %llu", (unsigned long long)used());
    CHECK(stderr_count("libgpuslice") == 0, "a valid limit says nothing");
}

/* CDMO_SHIM_DISABLE, which the container sets, does not lift the limit. */
static void case_disable_ignored(void)
{
    CHECK(slice_limit() == 1 * GiB && getenv("CDMO_SHIM_DISABLE"), "case runs with a limit and the old switch");
    open_driver();
    CHECK(in_shim((void *)Alloc), "dlsym must still give the shim's cuMemAlloc_v2, got %s", lib_of((void *)Alloc, NULL));
    CUdeviceptr a, b;
    OK(Alloc(&a, 1 * GiB));
    CHECK(Alloc(&b, 1) == CUDA_ERROR_OUT_OF_MEMORY, "the 1 GiB limit holds");
    size_t f, t;
    OK(GetInfo(&f, &t));
    CHECK(t == 1 * GiB && f == 0, "figures are the slice's: %zu/%zu", f, t);
    CHECK(stderr_count("warning: CDMO_SHIM_DISABLE=1 is ignored: a container cannot lift its slice's memory limit") == 1,
          "the shim says once that the switch is ignored");
}

static void case_dlsym(void)
{
    open_driver();
    const char *s = NULL;
    CHECK(in_shim((void *)Alloc), "dlsym(libcuda, cuMemAlloc_v2) -> %s", lib_of((void *)Alloc, NULL));
    lib_of((void *)Alloc, &s);
    CHECK(!strcmp(s, "cuMemAlloc_v2"), "wrapper is %s", s);
    for (int i = 0; i < 5; i++) {
        void *again = dlsym(hcuda, "cuMemAlloc_v2");
        CHECK(again == (void *)Alloc, "repeated lookup %d gave %p", i, again);
    }
    const char *hooked[] = {"cuMemAllocPitch_v2", "cuMemFree_v2", "cuMemGetInfo_v2", "cuDeviceTotalMem_v2",
                            "cuMemAllocManaged", "cuMemCreate", "cuMemRelease", "cuMemMap", "cuMemUnmap",
                            "cuMemRetainAllocationHandle", "cuArrayCreate_v2", "cuArray3DCreate_v2",
                            "cuArrayDestroy", "cuMipmappedArrayCreate", "cuMipmappedArrayDestroy",
                            "cuMemAllocAsync", "cuMemAllocAsync_ptsz", "cuMemFreeAsync", "cuMemFreeAsync_ptsz",
                            "cuMemAllocFromPoolAsync", "cuMemAllocFromPoolAsync_ptsz", "cuGetProcAddress",
                            "cuGetProcAddress_v2", "cuDevicePrimaryCtxRetain", "cuMemPoolCreate",
                            "cuMemPoolDestroy", "cuDeviceSetMemPool", "cuGraphInstantiateWithFlags",
                            "cuGraphInstantiateWithParams", "cuGraphInstantiateWithParams_ptsz",
                            "cuGraphLaunch", "cuGraphLaunch_ptsz", "cuGraphUpload", "cuGraphUpload_ptsz",
                            "cuGraphExecDestroy", "cuDeviceGraphMemTrim"};
    for (size_t i = 0; i < sizeof hooked / sizeof *hooked; i++) {
        void *p = dlsym(hcuda, hooked[i]);
        CHECK(in_shim(p), "dlsym(libcuda, %s) -> %s", hooked[i], lib_of(p, NULL));
        lib_of(p, &s);
        CHECK(!strcmp(s, hooked[i]), "dlsym(libcuda, %s) gave wrapper %s", hooked[i], s);
    }
    const char *untouched[] = {"cuInit", "cuGetExportTable", "cuMemAlloc", "cuStreamSynchronize",
                               "cuArrayGetMemoryRequirements", "cuDeviceGetUuid_v2", "cuMemPoolTrimTo",
                               "cuDeviceGetMemPool", "cuGraphInstantiate", "cuGraphInstantiate_v2",
                               "cuDevicePrimaryCtxGetState"};
    for (size_t i = 0; i < sizeof untouched / sizeof *untouched; i++) {
        void *p = dlsym(hcuda, untouched[i]);
        CHECK(in_fake(p), "dlsym(libcuda, %s) must be the driver's, got %s", untouched[i], lib_of(p, NULL));
    }
    CHECK(dlsym(hcuda, "cuNoSuchFunction") == NULL, "unknown names stay unknown");
    CHECK(dlsym(hcuda, "cuNoSuchFunction") == NULL && dlerror() != NULL, "dlerror is set");
    /* cuGetExportTable reaches the driver untouched */
    CUresult (*get)(const void **, const CUuuid *) = (CUresult(*)(const void **, const CUuuid *))dlsym(hcuda, "cuGetExportTable");
    const void *tbl = NULL;
    CUuuid id = {{0}};
    OK(get(&tbl, &id));
    CHECK(tbl && ((void *const *)tbl)[0] == (void *)0x1111, "export table passed through");
    /* NVML handle */
    void *nv1 = dlsym(hnvml, "nvmlDeviceGetMemoryInfo"), *nv2 = dlsym(hnvml, "nvmlDeviceGetMemoryInfo_v2");
    CHECK(in_shim(nv1) && in_shim(nv2), "NVML memory info must be the shim's: %s %s", lib_of(nv1, NULL), lib_of(nv2, NULL));
    void *uuid = dlsym(hnvml, "nvmlDeviceGetUUID");
    CHECK(strstr(lib_of(uuid, NULL), "libnvidia-ml"), "nvmlDeviceGetUUID untouched");
    /* other handles: untouched */
    void *hm = dlopen("libm.so.6", RTLD_NOW);
    CHECK(hm, "libm");
    void *cosp = dlsym(hm, "cos");
    CHECK(cosp && strstr(lib_of(cosp, NULL), "libm"), "dlsym(libm, cos) -> %s", lib_of(cosp, NULL));
    /* RTLD_DEFAULT: the preloaded shim first, as for linked programs */
    void *d = dlsym(RTLD_DEFAULT, "cuMemAlloc_v2");
    CHECK(in_shim(d), "RTLD_DEFAULT -> %s", lib_of(d, NULL));
    /* RTLD_NEXT is resolved relative to *this* program: the next object
     * defining cuMemAlloc_v2 after the executable is the preloaded shim.  Were
     * the shim's dlsym not a tail jump, glibc would search after the shim. */
    void *n = dlsym(RTLD_NEXT, "cuMemAlloc_v2");
    CHECK(n == d, "RTLD_NEXT from the program -> %s (%p), expected the shim (%p)", lib_of(n, NULL), n, d);
    void *nm = dlsym(RTLD_NEXT, "malloc");
    CHECK(nm == dlsym(RTLD_DEFAULT, "malloc"), "RTLD_NEXT malloc");
}

/* (name, version, flags) -> what the caller must receive */
struct pa_case { const char *name; int version; cuuint64_t flags; const char *want; int shim; int status; };
#define PTDS CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
#define LEGACY CU_GET_PROC_ADDRESS_LEGACY_STREAM
static const struct pa_case pa_cases[] = {
    {"cuMemAlloc", 3020, 0, "cuMemAlloc_v2", 1, 0},
    {"cuMemAlloc", 12000, PTDS, "cuMemAlloc_v2", 1, 0},
    {"cuMemAlloc", 2000, 0, "cuMemAlloc", 0, 0},              /* v1 ABI: never the _v2 wrapper */
    {"cuMemAllocPitch", 3020, 0, "cuMemAllocPitch_v2", 1, 0},
    {"cuMemFree", 11000, 0, "cuMemFree_v2", 1, 0},
    {"cuMemGetInfo", 3020, 0, "cuMemGetInfo_v2", 1, 0},
    {"cuMemGetInfo", 2000, 0, "cuMemGetInfo", 0, 0},
    {"cuDeviceTotalMem", 12000, 0, "cuDeviceTotalMem_v2", 1, 0},
    {"cuMemAllocManaged", 6000, 0, "cuMemAllocManaged", 1, 0},
    {"cuMemAllocManaged", 5050, 0, NULL, 0, 2},
    {"cuMemCreate", 10020, 0, "cuMemCreate", 1, 0},
    {"cuMemCreate", 10010, 0, NULL, 0, 2},
    {"cuMemRelease", 12000, 0, "cuMemRelease", 1, 0},
    {"cuMemMap", 12000, 0, "cuMemMap", 1, 0},
    {"cuMemUnmap", 12000, 0, "cuMemUnmap", 1, 0},
    {"cuMemRetainAllocationHandle", 11000, 0, "cuMemRetainAllocationHandle", 1, 0},
    {"cuArrayCreate", 3020, 0, "cuArrayCreate_v2", 1, 0},
    {"cuArray3DCreate", 12000, 0, "cuArray3DCreate_v2", 1, 0},
    {"cuArrayDestroy", 2000, 0, "cuArrayDestroy", 1, 0},
    {"cuMipmappedArrayCreate", 5000, 0, "cuMipmappedArrayCreate", 1, 0},
    {"cuMipmappedArrayDestroy", 12000, 0, "cuMipmappedArrayDestroy", 1, 0},
    {"cuMemAllocAsync", 11020, 0, "cuMemAllocAsync", 1, 0},
    {"cuMemAllocAsync", 11020, LEGACY, "cuMemAllocAsync", 1, 0},
    {"cuMemAllocAsync", 11020, PTDS, "cuMemAllocAsync_ptsz", 1, 0},
    {"cuMemAllocAsync", 12080, PTDS, "cuMemAllocAsync_ptsz", 1, 0},
    {"cuMemAllocAsync", 11010, 0, NULL, 0, 2},
    {"cuMemFreeAsync", 11020, 0, "cuMemFreeAsync", 1, 0},
    {"cuMemFreeAsync", 11020, PTDS, "cuMemFreeAsync_ptsz", 1, 0},
    {"cuMemAllocFromPoolAsync", 11020, 0, "cuMemAllocFromPoolAsync", 1, 0},
    {"cuMemAllocFromPoolAsync", 11020, PTDS, "cuMemAllocFromPoolAsync_ptsz", 1, 0},
    {"cuGetProcAddress", 11030, 0, "cuGetProcAddress", 1, 0},
    {"cuGetProcAddress", 11080, 0, "cuGetProcAddress", 1, 0},
    {"cuGetProcAddress", 12000, 0, "cuGetProcAddress_v2", 1, 0},
    {"cuGetProcAddress", 12080, PTDS, "cuGetProcAddress_v2", 1, 0},
    {"cuGetProcAddress", 11020, 0, NULL, 0, 2},
    {"cuDevicePrimaryCtxRetain", 12000, 0, "cuDevicePrimaryCtxRetain", 1, 0},
    {"cuMemPoolCreate", 11020, 0, "cuMemPoolCreate", 1, 0},
    {"cuMemPoolDestroy", 12000, 0, "cuMemPoolDestroy", 1, 0},
    {"cuDeviceSetMemPool", 11020, 0, "cuDeviceSetMemPool", 1, 0},
    {"cuGraphInstantiate", 12000, 0, "cuGraphInstantiateWithFlags", 1, 0},
    {"cuGraphInstantiate", 11000, 0, "cuGraphInstantiate_v2", 0, 0},   /* older ABIs untouched */
    {"cuGraphInstantiate", 10000, 0, "cuGraphInstantiate", 0, 0},
    {"cuGraphInstantiateWithFlags", 11040, 0, "cuGraphInstantiateWithFlags", 1, 0},
    {"cuGraphInstantiateWithParams", 12000, 0, "cuGraphInstantiateWithParams", 1, 0},
    {"cuGraphInstantiateWithParams", 12000, PTDS, "cuGraphInstantiateWithParams_ptsz", 1, 0},
    {"cuGraphLaunch", 12000, 0, "cuGraphLaunch", 1, 0},
    {"cuGraphLaunch", 12000, PTDS, "cuGraphLaunch_ptsz", 1, 0},
    {"cuGraphUpload", 11010, PTDS, "cuGraphUpload_ptsz", 1, 0},
    {"cuGraphUpload", 11000, 0, NULL, 0, 2},
    {"cuGraphExecDestroy", 10000, 0, "cuGraphExecDestroy", 1, 0},
    {"cuDeviceGraphMemTrim", 11040, 0, "cuDeviceGraphMemTrim", 1, 0},
    {"cuMemPoolTrimTo", 12000, 0, "cuMemPoolTrimTo", 0, 0},
    /* pass-through, every flavour */
    {"cuMemAdvise", 12000, 0, "cuMemAdvise", 0, 0},
    {"cuMemAdvise", 12020, 0, "cuMemAdvise_v2", 0, 0},
    {"cuMemPrefetchAsync", 12000, PTDS, "cuMemPrefetchAsync_ptsz", 0, 0},
    {"cuMemPrefetchAsync", 12080, PTDS, "cuMemPrefetchAsync_v2_ptsz", 0, 0},
    {"cuStreamSynchronize", 12000, PTDS, "cuStreamSynchronize_ptsz", 0, 0},
    {"cuStreamSynchronize", 12000, 0, "cuStreamSynchronize", 0, 0},
    {"cuGetExportTable", 12000, 0, "cuGetExportTable", 0, 0},
    {"cuInit", 12000, 0, "cuInit", 0, 0},
    {"cuNoSuchFunction", 12000, 0, NULL, 0, 1},
};

static void check_pa(CUresult (*gpa2)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *),
                     CUresult (*gpa1)(const char *, void **, int, cuuint64_t), int internal)
{
    for (size_t i = 0; i < sizeof pa_cases / sizeof *pa_cases; i++) {
        const struct pa_case *c = &pa_cases[i];
        for (int v = 1; v <= 2; v++) {
            void *fn = (void *)0x1;
            CUdriverProcAddressQueryResult st = (CUdriverProcAddressQueryResult)77;
            CUresult r = v == 2 ? gpa2(c->name, &fn, c->version, c->flags, &st) : gpa1(c->name, &fn, c->version, c->flags);
            const char *s = "?";
            if (!c->want) {
                if (v == 2) {
                    CHECK(r == CUDA_SUCCESS && fn == NULL && (int)st == c->status,
                          "%s@%d: r=%d fn=%p status=%d, want NULL/status %d", c->name, c->version, r, fn, st, c->status);
                } else {
                    CHECK(r == CUDA_ERROR_NOT_FOUND, "v1 %s@%d: r=%d", c->name, c->version, r);
                }
                continue;
            }
            CHECK(r == CUDA_SUCCESS && fn, "%s@%d/%llu (v%d): r=%d", c->name, c->version, (unsigned long long)c->flags, v, r);
            if (v == 2) CHECK(st == CU_GET_PROC_ADDRESS_SUCCESS, "%s: symbolStatus %d", c->name, st);
            const char *lib = lib_of(fn, &s);
            if (c->shim) {
                CHECK(strstr(lib, "libgpuslice") && !strcmp(s, c->want),
                      "%s@%d flags %llu (v%d): got %s in %s, want the shim's %s", c->name, c->version,
                      (unsigned long long)c->flags, v, s, lib, c->want);
            } else if (!internal || strcmp(c->want, "cuMemAlloc")) {
                CHECK(strstr(lib, "libcuda") && !strcmp(s, c->want), "%s@%d flags %llu (v%d): got %s in %s, want the driver's %s",
                      c->name, c->version, (unsigned long long)c->flags, v, s, lib, c->want);
            }
        }
    }
    void *fn;
    CHECK(gpa2("cuMemAlloc", &fn, 99999, 0, NULL) == CUDA_ERROR_INVALID_VALUE, "a version beyond the driver's is its error");
}

static void case_procaddr(void)
{
    open_driver();
    int internal = getenv("FAKE_PROCADDR_INTERNAL") != NULL;
    check_pa(GPA2, GPA, internal);
    /* cuGetProcAddress asked for itself, then used */
    CUresult (*self2)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *) = NULL;
    CUresult (*self1)(const char *, void **, int, cuuint64_t) = NULL;
    OK(GPA2("cuGetProcAddress", (void **)&self2, 12000, 0, NULL));
    OK(GPA2("cuGetProcAddress", (void **)&self1, 11030, 0, NULL));
    check_pa(self2, self1, internal);
    /* the per-thread wrapper calls the driver's per-thread entry point */
    CUresult (*a_ptsz)(CUdeviceptr *, size_t, CUstream) = NULL;
    CUresult (*f_ptsz)(CUdeviceptr, CUstream) = NULL;
    OK(GPA2("cuMemAllocAsync", (void **)&a_ptsz, 12000, PTDS, NULL));
    OK(GPA2("cuMemFreeAsync", (void **)&f_ptsz, 12000, PTDS, NULL));
    uint64_t u0 = used();
    CUdeviceptr p;
    OK(a_ptsz(&p, 64 * MiB, NULL));
    CHECK(!strcmp(FakeLast(), "cuMemAllocAsync_ptsz"), "forwarded to %s", FakeLast());
    CHECK(used() == u0 + 64 * MiB, "ptsz allocation counted");
    OK(f_ptsz(p, NULL));
    CHECK(!strcmp(FakeLast(), "cuMemFreeAsync_ptsz"), "forwarded to %s", FakeLast());
    CHECK(used() == u0 + 64 * MiB, "the freed block stays with its pool: still counted");
    OK(a_ptsz(&p, 48 * MiB, NULL));
    CHECK(used() == u0 + 64 * MiB, "served from what the pool keeps: nothing new counted (%llu)",
          (unsigned long long)(used() - u0));
    OK(f_ptsz(p, NULL));
}

static void case_accounting(void)
{
    open_driver();
    CHECK(used() == 0, "fresh slice");
    size_t f, t;
    OK(GetInfo(&f, &t));
    CHECK(t == 1 * GiB && f == 1 * GiB, "total = limit, free = limit: %zu %zu", t, f);
    size_t tm;
    OK(TotalMem(&tm, 0));
    CHECK(tm == 1 * GiB, "cuDeviceTotalMem_v2 = limit: %zu", tm);
    CUdeviceptr a, b, c;
    OK(Alloc(&a, 512 * MiB));
    CHECK(used() == 512 * MiB, "used %llu", (unsigned long long)used());
    CHECK(Alloc(&c, 600 * MiB) == CUDA_ERROR_OUT_OF_MEMORY, "beyond the limit is CUDA_ERROR_OUT_OF_MEMORY");
    CHECK(used() == 512 * MiB, "a refused allocation leaves no trace");
    OK(Alloc(&b, 512 * MiB));
    CHECK(used() == 1 * GiB, "exactly at the limit");
    CHECK(Alloc(&c, 1) == CUDA_ERROR_OUT_OF_MEMORY, "one byte over");
    OK(GetInfo(&f, &t));
    CHECK(f == 0 && t == 1 * GiB, "free clamps at 0");
    CHECK(Free(0xdead000000ULL) != CUDA_SUCCESS, "unknown pointer: the driver's error");
    CHECK(used() == 1 * GiB, "a failed free changes nothing");
    OK(Free(a));
    CHECK(used() == 512 * MiB, "free uncounts");
    CHECK(Free(a) != CUDA_SUCCESS && used() == 512 * MiB, "double free is the driver's error, counted once");
    OK(Free(b));
    CHECK(used() == 0, "back to zero");
    CHECK(FakePhysUsed() == 0, "driver agrees");
}

static void case_kinds(void)
{
    open_driver();
    /* pitch: the driver's pitch (2048 in the fake), not the width */
    CUdeviceptr p;
    size_t pitch;
    OK(Pitch(&p, &pitch, 1000, 100, 4));
    CHECK(pitch == 2048, "fake pitch %zu", pitch);
    CHECK(used() == 2048 * 100, "pitch x height counted: %llu", (unsigned long long)used());
    OK(Free(p));
    CHECK(used() == 0, "pitch freed");
    /* managed: counted in full */
    OK(Managed(&p, 100 * MiB, 1));
    CHECK(used() == 100 * MiB, "managed counted");
    OK(Free(p));
    CHECK(used() == 0, "managed freed");
    /* VMM, device location */
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    CUmemGenericAllocationHandle h, h2, hr;
    OK(Create(&h, 64 * MiB, &prop, 0));
    CHECK(used() == 64 * MiB, "cuMemCreate counted");
    CUdeviceptr va = 0x7f0000000000ULL;
    OK(Map(va, 64 * MiB, 0, h, 0));
    OK(Release(h));
    CHECK(used() == 64 * MiB, "released but still mapped: still counted");
    OK(Unmap(va, 64 * MiB));
    CHECK(used() == 0, "released and unmapped: uncounted (%llu)", (unsigned long long)used());
    CHECK(FakePhysUsed() == 0, "driver freed it too");
    /* retain adds a reference; one unmap covering two mappings */
    OK(Create(&h, 32 * MiB, &prop, 0));
    OK(Create(&h2, 32 * MiB, &prop, 0));
    OK(Map(va, 32 * MiB, 0, h, 0));
    OK(Map(va + 32 * MiB, 32 * MiB, 0, h2, 0));
    OK(Retain(&hr, (void *)(uintptr_t)(va + 4096)));
    CHECK(hr == h, "retain gives the handle back");
    OK(Release(h));
    OK(Release(h2));
    CHECK(used() == 64 * MiB, "mapped");
    OK(Unmap(va, 64 * MiB));
    CHECK(used() == 32 * MiB, "h still retained: %llu", (unsigned long long)used());
    OK(Release(hr));
    CHECK(used() == 0, "last reference gone");
    /* host location (NCCL's probe): not device memory */
    prop.location.type = CU_MEM_LOCATION_TYPE_HOST;
    OK(Create(&h, 16 * MiB, &prop, 0));
    CHECK(used() == 0, "host cuMemCreate not counted");
    OK(Release(h));
    prop.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
    OK(Create(&h, 16 * MiB, &prop, 0));
    CHECK(used() == 0, "host NUMA cuMemCreate not counted");
    OK(Release(h));
    /* VMM beyond the limit */
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    CHECK(Create(&h, 2 * GiB, &prop, 0) == CUDA_ERROR_OUT_OF_MEMORY, "VMM over the limit");
    /* arrays: settled to the driver's requirements */
    CUDA_ARRAY_DESCRIPTOR d2 = {.Width = 1000, .Height = 1000, .Format = CU_AD_FORMAT_FLOAT, .NumChannels = 4};
    CUarray arr;
    OK(ArrCreate(&arr, &d2));
    CUDA_ARRAY_MEMORY_REQUIREMENTS req;
    OK(ArrReq(&req, arr, 0));
    CHECK(req.size > 16000000 && used() == req.size, "2D array counted as %llu, driver says %zu",
          (unsigned long long)used(), req.size);
    OK(ArrDestroy(arr));
    CHECK(used() == 0, "array destroyed");
    CUDA_ARRAY3D_DESCRIPTOR d3 = {.Width = 100, .Height = 100, .Depth = 100, .Format = CU_AD_FORMAT_UNSIGNED_INT8,
                                  .NumChannels = 1, .Flags = 0};
    OK(Arr3DCreate(&arr, &d3));
    OK(ArrReq(&req, arr, 0));
    CHECK(used() == req.size && req.size >= 1000000, "3D array counted");
    OK(ArrDestroy(arr));
    d3.Flags = 0x40; /* sparse: commits nothing */
    OK(Arr3DCreate(&arr, &d3));
    CHECK(used() == 0, "sparse array not counted");
    OK(ArrDestroy(arr));
    d3.Flags = 0;
    CUmipmappedArray mip;
    OK(MipCreate(&mip, &d3, 4));
    CHECK(used() >= 1000000 + 125000, "mipmapped counted: %llu", (unsigned long long)used());
    OK(MipDestroy(mip));
    CHECK(used() == 0, "mipmapped destroyed");
    CUDA_ARRAY_DESCRIPTOR huge = {.Width = 65536, .Height = 65536, .Format = CU_AD_FORMAT_FLOAT, .NumChannels = 4};
    CHECK(ArrCreate(&arr, &huge) == CUDA_ERROR_OUT_OF_MEMORY, "array over the limit");
    /* stream-ordered: counted while allocated, then as what the pool keeps */
    CUdeviceptr q1, q2;
    CUmemoryPool pool;
    CUmemPoolProps pp;
    memset(&pp, 0, sizeof pp);
    pp.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    pp.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    OK(PoolCreate(&pool, &pp));
    OK(AllocAsync(&q1, 100 * MiB, NULL));
    OK(AllocPool(&q2, 200 * MiB, pool, NULL));
    CHECK(used() == 300 * MiB, "async counted");
    CHECK(AllocAsync(&p, 800 * MiB, NULL) == CUDA_ERROR_OUT_OF_MEMORY, "async over the limit");
    OK(FreeAsync(q1, NULL));
    OK(FreeAsync(q2, NULL));
    CHECK(used() == 300 * MiB, "freed blocks are still reserved by their pools: %llu", (unsigned long long)used());
    CHECK(FakePhysUsed() == 300 * MiB, "as the driver says");
    OK(StreamSync(NULL)); /* release threshold 0: the pools give the memory back */
    CHECK(FakePhysUsed() == 0, "nothing leaked in the driver");
    CHECK(Alloc(&p, 1 * GiB) == CUDA_SUCCESS, "the pools' bytes are re-measured before a refusal");
    OK(Free(p));
    CHECK(used() == 0, "all back: %llu", (unsigned long long)used());
    OK(PoolDestroy(pool));
}

static void case_rollback(void)
{
    /* FAKE_TOTAL=256 MiB physical, limit 1 GiB */
    open_driver();
    size_t f, t;
    OK(GetInfo(&f, &t));
    CHECK(t == 256 * MiB && f == 256 * MiB, "total = min(limit, physical): %zu", t);
    CUdeviceptr p;
    CHECK(Alloc(&p, 300 * MiB) == CUDA_ERROR_OUT_OF_MEMORY, "the driver's own OOM");
    OK(Alloc(&p, 200 * MiB));
    CHECK(used() == 200 * MiB, "the failed call was rolled back: %llu", (unsigned long long)used());
    OK(Free(p));
    CUmemAllocationProp prop = {.type = CU_MEM_ALLOCATION_TYPE_PINNED, .location = {CU_MEM_LOCATION_TYPE_DEVICE, 0}};
    CUmemGenericAllocationHandle h;
    CHECK(Create(&h, 300 * MiB, &prop, 0) == CUDA_ERROR_OUT_OF_MEMORY, "VMM driver failure");
    CHECK(used() == 0, "VMM rolled back");
}

static void case_nvml(void)
{
    open_driver();
    nvmlReturn_t (*init)(void) = (nvmlReturn_t(*)(void))sym(hnvml, "nvmlInit_v2");
    nvmlReturn_t (*byidx)(unsigned, nvmlDevice_t *) = (nvmlReturn_t(*)(unsigned, nvmlDevice_t *))sym(hnvml, "nvmlDeviceGetHandleByIndex_v2");
    nvmlReturn_t (*m1)(nvmlDevice_t, nvmlMemory_t *) = (nvmlReturn_t(*)(nvmlDevice_t, nvmlMemory_t *))sym(hnvml, "nvmlDeviceGetMemoryInfo");
    nvmlReturn_t (*m2)(nvmlDevice_t, nvmlMemory_v2_t *) = (nvmlReturn_t(*)(nvmlDevice_t, nvmlMemory_v2_t *))sym(hnvml, "nvmlDeviceGetMemoryInfo_v2");
    uint64_t lim = slice_limit();
    nvmlDevice_t dev;
    CHECK(init() == NVML_SUCCESS && byidx(0, &dev) == NVML_SUCCESS, "nvml init");
    CUdeviceptr p;
    OK(Alloc(&p, 512 * MiB));
    nvmlMemory_t a;
    CHECK(m1(dev, &a) == NVML_SUCCESS, "v1");
    const char *phys_used = getenv("FAKE_NVML_USED");
    if (!phys_used) {
        CHECK(a.total == lim && a.used == 512 * MiB && a.free == lim - 512 * MiB,
              "v1 under the limit: total %llu used %llu free %llu", a.total, a.used, a.free);
    } else { /* the GPU is nearly full: free follows the physical free */
        uint64_t phys_free = 80 * GiB - strtoull(phys_used, NULL, 0) - FakePhysUsed();
        CHECK(phys_free < lim - 512 * MiB, "the case must leave less physical than slice free");
        CHECK(a.total == lim && a.free == phys_free && a.free + a.used == a.total,
              "v1 clamped: total %llu used %llu free %llu", a.total, a.used, a.free);
    }
    nvmlMemory_v2_t b;
    memset(&b, 0xff, sizeof b);
    b.version = GS_NVML_MEMORY_V2;
    CHECK(m2(dev, &b) == NVML_SUCCESS, "v2");
    CHECK(b.total == a.total && b.free == a.free && b.used == a.used && b.reserved == 0,
          "v2 agrees with v1: total %llu used %llu free %llu reserved %llu", b.total, b.used, b.free, b.reserved);
    b.version = 1;
    CHECK(m2(dev, &b) != NVML_SUCCESS, "a wrong struct version is NVML's error, passed through");
    /* the CUDA and NVML views agree */
    size_t f, t;
    OK(GetInfo(&f, &t));
    CHECK(t == a.total, "CUDA total %zu == NVML total %llu", t, a.total);
    if (!phys_used) CHECK(f == a.free, "CUDA free %zu == NVML free %llu", f, a.free);
}

/* ---- several processes ------------------------------------------------- */
static void race(int nproc)
{
    open_driver();
    const uint64_t chunk = 8 * MiB, lim = slice_limit();
    int go[2], res[2], hold[2];
    CHECK(pipe(go) == 0 && pipe(res) == 0 && pipe(hold) == 0, "pipes");
    for (int i = 0; i < nproc; i++) {
        pid_t pid = fork();
        CHECK(pid >= 0, "fork");
        if (pid == 0) {
            close(go[1]);
            close(hold[1]);
            char c;
            if (read(go[0], &c, 1) != 1) _exit(2);
            int n = 0;
            CUdeviceptr p;
            CUresult r;
            while ((r = Alloc(&p, chunk)) == CUDA_SUCCESS) n++;
            if (r != CUDA_ERROR_OUT_OF_MEMORY) { fprintf(stderr, "  child alloc error %d after %d\n", r, n); _exit(3); }
            if (write(res[1], &n, sizeof n) != sizeof n) _exit(4);
            if (read(hold[0], &c, 1) != 0) _exit(5); /* hold until the parent closes hold */
            exit(0); /* a normal exit: the shim gives the share back */
        }
    }
    close(go[0]);
    close(res[1]);
    close(hold[0]);
    char start[64];
    memset(start, 1, sizeof start);
    size_t want = (size_t)nproc < sizeof start ? (size_t)nproc : sizeof start;
    CHECK(write(go[1], start, want) == (ssize_t)want, "start");
    long total = 0;
    for (int i = 0; i < nproc; i++) {
        int n;
        CHECK(read(res[0], &n, sizeof n) == sizeof n, "result %d", i);
        total += n;
    }
    CHECK((uint64_t)total == lim / chunk, "%d processes got %ld chunks together; the limit holds exactly %llu",
          nproc, total, (unsigned long long)(lim / chunk));
    CHECK(used() == lim, "the slice is full: %llu", (unsigned long long)used());
    close(go[1]);
    close(hold[1]);
    for (int i = 0; i < nproc; i++) {
        int st;
        CHECK(wait(&st) > 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "child status %d", st);
    }
    CHECK(used() == 0, "children exited: their shares are back (%llu)", (unsigned long long)used());
}
static void case_race2(void) { race(2); }
static void case_race16(void) { race(16); }

static void case_sigkill(void)
{
    open_driver();
    for (int reap = 0; reap < 2; reap++) {
        int ready[2];
        CHECK(pipe(ready) == 0, "pipe");
        pid_t pid = fork();
        if (pid == 0) {
            CUdeviceptr p;
            if (Alloc(&p, 768 * MiB) != CUDA_SUCCESS) _exit(2);
            char c = 1;
            if (write(ready[1], &c, 1) != 1) _exit(3);
            pause();
            _exit(0);
        }
        char c;
        CHECK(read(ready[0], &c, 1) == 1, "child allocated");
        CHECK(used() == 768 * MiB, "the child's share is visible: %llu", (unsigned long long)used());
        kill(pid, SIGKILL);
        if (reap) {
            waitpid(pid, NULL, 0);
        } else { /* a zombie: dead, not yet reaped */
            for (int i = 0; i < 200; i++) {
                char path[64], st[512] = {0};
                snprintf(path, sizeof path, "/proc/%d/stat", pid);
                FILE *fp = fopen(path, "r");
                if (fp) { if (!fgets(st, sizeof st, fp)) st[0] = 0; fclose(fp); }
                char *q = strrchr(st, ')');
                if (q && q[2] == 'Z') break;
                usleep(10000);
            }
        }
        CUdeviceptr p;
        OK(Alloc(&p, 512 * MiB)); /* fits only once the dead share is recovered */
        CHECK(used() == 512 * MiB, "recovered: %llu", (unsigned long long)used());
        OK(Free(p));
        if (!reap) waitpid(pid, NULL, 0);
        close(ready[0]);
        close(ready[1]);
    }
}

static void case_fork(void)
{
    open_driver();
    CUdeviceptr a;
    OK(Alloc(&a, 256 * MiB));
    pid_t pid = fork();
    if (pid == 0) {
        g_case = "fork(child)";
        CHECK(used() == 256 * MiB, "child sees the slice's usage");
        CUdeviceptr b, c;
        OK(Alloc(&b, 512 * MiB));
        CHECK(used() == 768 * MiB, "child counted");
        CHECK(Alloc(&c, 512 * MiB) == CUDA_ERROR_OUT_OF_MEMORY, "one limit for parent and child");
        /* the parent's pointer is not the child's to uncount */
        Free(a);
        CHECK(used() == 768 * MiB, "child free of the parent's pointer does not uncount: %llu", (unsigned long long)used());
        exit(0); /* exits holding b: the shim gives its share back at exit */
    }
    int st;
    CHECK(waitpid(pid, &st, 0) == pid && WIFEXITED(st) && WEXITSTATUS(st) == 0, "child ok");
    CHECK(used() == 256 * MiB, "child's share released at its exit: %llu", (unsigned long long)used());
    OK(Free(a));
    CHECK(used() == 0, "parent's free");
}

static void case_exec(void)
{
    open_driver();
    if (!getenv("SHIMTEST_EXECED")) {
        CUdeviceptr a;
        OK(Alloc(&a, 700 * MiB));
        CHECK(used() == 700 * MiB, "before exec");
        setenv("SHIMTEST_EXECED", "1", 1);
        char self[PATH_MAX];
        ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
        CHECK(n > 0, "self");
        self[n] = 0;
        execl(self, self, "--case", "exec", (char *)NULL);
        CHECK(0, "exec: %s", strerror(errno));
    }
    /* same pid, same start time, new image: the old image's memory is gone */
    CUdeviceptr b;
    OK(Alloc(&b, 700 * MiB));
    CHECK(used() == 700 * MiB, "pre-exec share reclaimed: %llu", (unsigned long long)used());
}

static void case_stale_report(void)
{
    /* a process that dies without exiting normally (_exit skips the shim's
     * destructor, as SIGKILL does): reports drop its share without waiting
     * for allocation pressure */
    open_driver();
    nvmlReturn_t (*init)(void) = (nvmlReturn_t(*)(void))sym(hnvml, "nvmlInit_v2");
    nvmlReturn_t (*byidx)(unsigned, nvmlDevice_t *) = (nvmlReturn_t(*)(unsigned, nvmlDevice_t *))sym(hnvml, "nvmlDeviceGetHandleByIndex_v2");
    nvmlReturn_t (*m1)(nvmlDevice_t, nvmlMemory_t *) = (nvmlReturn_t(*)(nvmlDevice_t, nvmlMemory_t *))sym(hnvml, "nvmlDeviceGetMemoryInfo");
    nvmlDevice_t dev;
    CHECK(init() == NVML_SUCCESS && byidx(0, &dev) == NVML_SUCCESS, "nvml");
    CHECK(used() == 0, "empty");
    pid_t pid = fork();
    if (pid == 0) {
        CUdeviceptr p;
        _exit(Alloc(&p, 300 * MiB) == CUDA_SUCCESS ? 0 : 1);
    }
    int st;
    CHECK(waitpid(pid, &st, 0) == pid && WIFEXITED(st) && WEXITSTATUS(st) == 0, "child");
    nvmlMemory_t m;
    CHECK(m1(dev, &m) == NVML_SUCCESS && m.used == 0, "NVML reaps the dead share at once: used %llu", m.used);
    pid = fork();
    if (pid == 0) {
        CUdeviceptr p;
        _exit(Alloc(&p, 300 * MiB) == CUDA_SUCCESS ? 0 : 1);
    }
    CHECK(waitpid(pid, &st, 0) == pid && WIFEXITED(st) && WEXITSTATUS(st) == 0, "child");
    usleep(1100000);
    CHECK(used() == 0, "cuMemGetInfo reaps within a second: %llu", (unsigned long long)used());
}

struct thr { int id; int fail; };
static void *churn(void *arg)
{
    struct thr *t = arg;
    unsigned s = (unsigned)t->id * 7919u + 1;
    CUdeviceptr held[16] = {0};
    for (int i = 0; i < 20000; i++) {
        int k = (int)(rand_r(&s) % 16);
        if (held[k]) {
            if (Free(held[k]) != CUDA_SUCCESS) t->fail++;
            held[k] = 0;
        } else if (Alloc(&held[k], (rand_r(&s) % 4 + 1) * MiB) != CUDA_SUCCESS) {
            t->fail++; /* 8 threads x 16 x 4 MiB = 512 MiB < limit: never refused */
            held[k] = 0;
        }
    }
    for (int k = 0; k < 16; k++) if (held[k] && Free(held[k]) != CUDA_SUCCESS) t->fail++;
    return NULL;
}

static void case_threads(void)
{
    open_driver();
    pthread_t th[8];
    struct thr a[8];
    for (int i = 0; i < 8; i++) {
        a[i].id = i;
        a[i].fail = 0;
        pthread_create(&th[i], NULL, churn, &a[i]);
    }
    for (int i = 0; i < 8; i++) {
        pthread_join(th[i], NULL);
        CHECK(a[i].fail == 0, "thread %d: %d failures", i, a[i].fail);
    }
    CHECK(used() == 0, "8 threads x 20000 operations leave nothing counted: %llu", (unsigned long long)used());
    CHECK(FakePhysUsed() == 0, "driver agrees");
}

static void case_many(void)
{
    /* 200000 live allocations, then all freed: the table is O(1) and exact */
    open_driver();
    static CUdeviceptr p[200000];
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int i = 0; i < 200000; i++) OK(Alloc(&p[i], 4096));
    CHECK(used() == 200000ULL * 4096, "all counted");
    for (int i = 0; i < 200000; i += 2) OK(Free(p[i]));
    for (int i = 1; i < 200000; i += 2) OK(Free(p[i]));
    clock_gettime(CLOCK_MONOTONIC, &t1);
    CHECK(used() == 0, "all uncounted: %llu", (unsigned long long)used());
    double s = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
    printf("  # 400000 tracked alloc/free calls in %.3f s\n", s);
    CHECK(s < 5.0, "too slow: %.3f s", s);
}

static void case_region_file(void)
{
    /* the ledger is <ledger dir>/gpu-<uuid>, whatever CDMO_SLICE says */
    open_driver();
    CUdeviceptr p;
    OK(Alloc(&p, MiB));
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/ledger/gpu-5b3b5d0c1f2e4a779c10abcdef012300", getenv("SHIMTEST_DIR"));
    struct stat st;
    CHECK(stat(path, &st) == 0, "ledger file %s: %s", path, strerror(errno));
    CHECK((st.st_mode & 0777) == 0666, "mode %o, want 0666 so any uid of the slice can join", st.st_mode & 0777);
    DIR *d = opendir("ledger");
    CHECK(d, "ledger dir");
    int files = 0;
    for (struct dirent *e; (e = readdir(d));) files += e->d_name[0] != '.';
    closedir(d);
    CHECK(files == 1, "one file in the ledger, %d", files);
}

/* Issue 24 (c): a ledger that cannot be opened refuses every allocation on
 * every GPU (never a limit of this process alone), loads of code too, and
 * says so once; queries still answer, with nothing free. */
static void case_closed(void)
{
    open_driver();
    CUdeviceptr p;
    for (int dev = 0; dev < 2; dev++) {
        FakeSetDevice(dev);
        CHECK(Alloc(&p, MiB) == CUDA_ERROR_OUT_OF_MEMORY, "device %d: fail closed", dev);
        CHECK(Managed(&p, MiB, 1) == CUDA_ERROR_OUT_OF_MEMORY, "managed: fail closed");
        CHECK(AllocAsync(&p, MiB, NULL) == CUDA_ERROR_OUT_OF_MEMORY, "async: fail closed");
        CUmemAllocationProp prop = {.type = CU_MEM_ALLOCATION_TYPE_PINNED,
                                    .location = {CU_MEM_LOCATION_TYPE_DEVICE, dev}};
        CUmemGenericAllocationHandle h;
        CHECK(Create(&h, 2 * MiB, &prop, 0) == CUDA_ERROR_OUT_OF_MEMORY, "cuMemCreate: fail closed");
        CUresult (*load)(CUmodule *, const void *) = (CUresult(*)(CUmodule *, const void *))sym(hcuda, "cuModuleLoadData");
        CUmodule m;
        CHECK(load(&m, "fakemod:1048576") == CUDA_ERROR_OUT_OF_MEMORY, "a module's globals: fail closed");
        CHECK(FakeModuleBytes() == 0, "the refused module was unloaded");
        size_t f, t;
        OK(GetInfo(&f, &t)); /* a query never fails because of the shim */
        CHECK(t == 1 * GiB && f == 0, "total %zu (the limit), free %zu (nothing can be had)", t, f);
    }
    CHECK(FakePhysUsed() == 0, "nothing reached the driver: %llu", (unsigned long long)FakePhysUsed());
    CHECK(stderr_count("libgpuslice") == 1, "one warning, got %d", stderr_count("libgpuslice"));
    CHECK(stderr_count("every allocation of device memory is refused") == 1, "says what it does");
    CHECK(stderr_count("ledger/gpu-") == 1, "names the ledger it could not use");
}

/* Issue 24 (b): no variable chooses another ledger.  A second process with
 * its own CDMO_SHIM_DIR, CDMO_SLICE and TMPDIR shares the first one's. */
static void case_ledger_fixed(void)
{
    open_driver();
    if (getenv("SHIMTEST_SECOND")) {
        CUdeviceptr b;
        CHECK(Alloc(&b, 600 * MiB) == CUDA_ERROR_OUT_OF_MEMORY, "the first process's 600 MiB counts here");
        OK(Alloc(&b, 400 * MiB));
        _exit(0);
    }
    CUdeviceptr a;
    OK(Alloc(&a, 600 * MiB));
    pid_t pid = fork();
    if (pid == 0) {
        setenv("SHIMTEST_SECOND", "1", 1);
        setenv("CDMO_SHIM_DIR", "other-ledger", 1);
        setenv("CDMO_SLICE", "team-b/another", 1);
        setenv("TMPDIR", "other-ledger", 1);
        mkdir("other-ledger", 0777);
        char self[PATH_MAX];
        ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
        if (n <= 0) _exit(3);
        self[n] = 0;
        execl(self, self, "--case", "ledger_fixed", (char *)NULL);
        _exit(4);
    }
    int st;
    CHECK(waitpid(pid, &st, 0) == pid && WIFEXITED(st) && WEXITSTATUS(st) == 0, "second process: %d", st);
    DIR *d = opendir("other-ledger");
    CHECK(d, "other-ledger");
    int files = 0;
    for (struct dirent *e; (e = readdir(d));) files += e->d_name[0] != '.';
    closedir(d);
    CHECK(files == 0, "nothing written where the variables point");
    CHECK(used() == 600 * MiB, "the second process's share went back at its exit");
}

/* A ledger left from an earlier boot is started afresh: the shares its slots
 * hold belong to processes that are all gone, even those the shim cannot
 * judge (another pid namespace).  Layout of the file (region.c, version 2,
 * x86-64): boot id at 48 (40 bytes), slots from 192, 32 bytes each, the pid
 * first and the pid-namespace inode at +16. */
#define LEDGER_BOOT 48
#define LEDGER_SLOTS 192
static void case_stale_boot(void)
{
    open_driver();
    const char *stage = getenv("SHIMTEST_STAGE");
    char path[PATH_MAX];
    snprintf(path, sizeof path, "ledger/gpu-5b3b5d0c1f2e4a779c10abcdef012300");
    if (!stage) {
        pid_t pid = fork();
        if (pid == 0) {
            CUdeviceptr p;
            _exit(Alloc(&p, 600 * MiB) == CUDA_SUCCESS ? 0 : 1); /* no exit handler: the share stays */
        }
        int st;
        CHECK(waitpid(pid, &st, 0) == pid && WIFEXITED(st) && WEXITSTATUS(st) == 0, "child");
        int fd = open(path, O_RDWR);
        CHECK(fd >= 0, "ledger %s", path);
        char boot[40] = {0}, want[40] = {0};
        FILE *b = fopen("/proc/sys/kernel/random/boot_id", "r");
        CHECK(b && fgets(want, sizeof want, b), "boot id");
        fclose(b);
        want[strcspn(want, "\n")] = 0;
        CHECK(pread(fd, boot, sizeof boot, LEDGER_BOOT) == sizeof boot && !strcmp(boot, want),
              "the ledger is stamped with this boot (%s)", boot);
        int found = 0;
        for (int i = 0; i < 1024 && !found; i++) {
            uint32_t spid;
            CHECK(pread(fd, &spid, 4, LEDGER_SLOTS + 32 * i) == 4, "slot");
            if (spid != (uint32_t)pid) continue;
            uint64_t other_ns = 1; /* a pid namespace the shim cannot judge: kept */
            CHECK(pwrite(fd, &other_ns, 8, LEDGER_SLOTS + 32 * i + 16) == 8, "pidns");
            found = 1;
        }
        CHECK(found, "the child's slot");
        close(fd);
        setenv("SHIMTEST_STAGE", "same-boot", 1);
    } else if (!strcmp(stage, "same-boot")) {
        CHECK(used() == 600 * MiB, "a share the shim cannot judge is kept: %llu MiB",
              (unsigned long long)(used() / MiB));
        int fd = open(path, O_RDWR);
        CHECK(fd >= 0 && pwrite(fd, "an-earlier-boot", 16, LEDGER_BOOT) == 16, "stamp another boot");
        close(fd);
        setenv("SHIMTEST_STAGE", "next-boot", 1);
    } else {
        CHECK(used() == 0, "a ledger of an earlier boot starts afresh: %llu MiB", (unsigned long long)(used() / MiB));
        return;
    }
    char self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    CHECK(n > 0, "self");
    self[n] = 0;
    execl(self, self, "--case", "stale_boot", (char *)NULL); /* a new image opens the ledger again */
    CHECK(0, "exec: %s", strerror(errno));
}

/* Each allocation refused for the limit is counted in the ledger, by every
 * process of the slice, for the node's agent to read; one that fits is not.
 * The count is the 32-bit word at 20 (region.c, version 2). */
#define LEDGER_REFUSED 20
static uint32_t ledger_refused(void)
{
    uint32_t n = UINT32_MAX;
    int fd = open("ledger/gpu-5b3b5d0c1f2e4a779c10abcdef012300", O_RDONLY);
    CHECK(fd >= 0 && pread(fd, &n, sizeof n, LEDGER_REFUSED) == sizeof n, "read the refusal count");
    close(fd);
    return n;
}

static void case_refusal_count(void)
{
    open_driver();
    CUdeviceptr a, b;
    OK(Alloc(&a, 512 * MiB));
    CHECK(ledger_refused() == 0, "an allocation that fits is no refusal: %u", ledger_refused());
    CHECK(Alloc(&b, 600 * MiB) == CUDA_ERROR_OUT_OF_MEMORY, "over the limit with what is held");
    CHECK(ledger_refused() == 1, "one refusal: %u", ledger_refused());
    CHECK(Alloc(&b, 2 * GiB) == CUDA_ERROR_OUT_OF_MEMORY, "larger than the limit");
    CHECK(ledger_refused() == 2, "two refusals: %u", ledger_refused());
    pid_t pid = fork();
    if (pid == 0) {
        CUdeviceptr c;
        _exit(Alloc(&c, 600 * MiB) == CUDA_ERROR_OUT_OF_MEMORY ? 0 : 1);
    }
    int st;
    CHECK(waitpid(pid, &st, 0) == pid && WIFEXITED(st) && WEXITSTATUS(st) == 0, "the child was refused");
    CHECK(ledger_refused() == 3, "another process's refusal counts in the slice's ledger: %u", ledger_refused());
    OK(Free(a));
    OK(Alloc(&b, 1 * GiB));
    CHECK(ledger_refused() == 3, "a fit after a free is no refusal: %u", ledger_refused());
}

/* Issue 24 (a): what a module's globals commit is charged at its load, through
 * every way a program finds the loaders; a load that does not fit is undone
 * and refused; an unload gives the bytes back. */
typedef CUresult (*pfn_mload)(CUmodule *, const void *);
typedef CUresult (*pfn_mfile)(CUmodule *, const char *);
typedef CUresult (*pfn_mex)(CUmodule *, const void *, unsigned, CUjit_option *, void **);
typedef CUresult (*pfn_munload)(CUmodule);
typedef CUresult (*pfn_lload)(CUlibrary *, const void *, CUjit_option *, void **, unsigned,
                              CUlibraryOption *, void **, unsigned);
typedef CUresult (*pfn_lfile)(CUlibrary *, const char *, CUjit_option *, void **, unsigned,
                              CUlibraryOption *, void **, unsigned);
typedef CUresult (*pfn_lunload)(CUlibrary);

static void module_cycle(pfn_mload load, pfn_munload unload, const char *how)
{
    uint64_t u0 = used(), d0 = FakeModuleBytes();
    CUmodule a, b, c;
    OK(load(&a, "fakemod:419430400"));
    CHECK(in_shim((void *)load), "%s: the shim's loader, got %s", how, lib_of((void *)load, NULL));
    CHECK(used() == u0 + 400 * MiB, "%s: 400 MiB of globals counted: %llu MiB", how,
          (unsigned long long)((used() - u0) / MiB));
    OK(load(&b, "fakemod:419430400"));
    CHECK(load(&c, "fakemod:419430400") == CUDA_ERROR_OUT_OF_MEMORY, "%s: a third 400 MiB is over 1 GiB", how);
    CHECK(c == NULL, "%s: no module handed out", how);
    CHECK(FakeModuleBytes() == d0 + 800 * MiB, "%s: the refused module was unloaded", how);
    CUdeviceptr p;
    CHECK(Alloc(&p, 300 * MiB) == CUDA_ERROR_OUT_OF_MEMORY, "%s: modules and allocations share the limit", how);
    OK(unload(a));
    CHECK(used() == u0 + 400 * MiB, "%s: an unload gives its bytes back", how);
    OK(Alloc(&p, 300 * MiB));
    OK(Free(p));
    OK(unload(b));
    CHECK(used() == u0, "%s: all back", how);
}

static void case_modules(void)
{
    open_driver();
    pfn_munload unload = (pfn_munload)sym(hcuda, "cuModuleUnload");
    CHECK(in_shim((void *)unload), "cuModuleUnload from %s", lib_of((void *)unload, NULL));
    module_cycle((pfn_mload)sym(hcuda, "cuModuleLoadData"), unload, "dlsym cuModuleLoadData");
    module_cycle((pfn_mload)sym(hcuda, "cuModuleLoadFatBinary"), unload, "dlsym cuModuleLoadFatBinary");
    module_cycle((pfn_mload)dlsym(RTLD_DEFAULT, "cuModuleLoadData"), unload, "link-time cuModuleLoadData");
    int internal = getenv("FAKE_PROCADDR_INTERNAL") != NULL;
    void *fn = NULL, *un = NULL;
    OK(GPA2("cuModuleLoadData", &fn, 12000, 0, NULL));
    OK(GPA("cuModuleUnload", &un, 11030, 0));
    CHECK(in_shim(un), "cuGetProcAddress(cuModuleUnload)");
    module_cycle((pfn_mload)fn, (pfn_munload)un, internal ? "cuGetProcAddress_v2, internal pointer"
                                                          : "cuGetProcAddress_v2");
    OK(GPA("cuModuleLoadData", &fn, 2000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM));
    module_cycle((pfn_mload)fn, unload, "cuGetProcAddress, per-thread flag");
    /* cuModuleLoadDataEx and cuModuleLoad (a file) */
    pfn_mex ex = (pfn_mex)sym(hcuda, "cuModuleLoadDataEx");
    pfn_mfile file = (pfn_mfile)sym(hcuda, "cuModuleLoad");
    CHECK(in_shim((void *)ex) && in_shim((void *)file), "cuModuleLoadDataEx, cuModuleLoad");
    FILE *f = fopen("big.cubin", "w");
    CHECK(f && fputs("fakemod:838860800", f) >= 0 && fclose(f) == 0, "write big.cubin");
    CUmodule m;
    OK(ex(&m, "fakemod:104857600", 0, NULL, NULL));
    CHECK(used() == 100 * MiB, "cuModuleLoadDataEx counted");
    CUdeviceptr p;
    OK(Alloc(&p, 200 * MiB));
    CHECK(file(&m, "big.cubin") == CUDA_ERROR_OUT_OF_MEMORY, "100 + 200 + 800 MiB is over 1 GiB");
    CHECK(FakeModuleBytes() == 100 * MiB, "refused file module unloaded");
    OK(Free(p));
    OK(file(&m, "big.cubin"));
    CHECK(used() == 900 * MiB, "cuModuleLoad counted: %llu MiB", (unsigned long long)(used() / MiB));
    /* a load the driver refuses costs nothing */
    CHECK(sym(hcuda, "cuModuleLoadData") && ((pfn_mload)sym(hcuda, "cuModuleLoadData"))(&m, "garbage") ==
          CUDA_ERROR_INVALID_VALUE, "the driver's error passes through");
    CHECK(used() == 900 * MiB, "nothing counted for a failed load");
}

/* Libraries commit their globals when loaded into a context (lazy loading):
 * the shim loads them into the current context inside its measurement. */
static void case_libraries(void)
{
    open_driver();
    pfn_lload load = (pfn_lload)sym(hcuda, "cuLibraryLoadData");
    pfn_lfile file = (pfn_lfile)sym(hcuda, "cuLibraryLoadFromFile");
    pfn_lunload unload = (pfn_lunload)sym(hcuda, "cuLibraryUnload");
    CHECK(in_shim((void *)load) && in_shim((void *)file) && in_shim((void *)unload), "library entry points");
    void *fn = NULL;
    OK(GPA2("cuLibraryLoadData", &fn, 12000, 0, NULL));
    CHECK(in_shim(fn), "cuGetProcAddress(cuLibraryLoadData)");
    CUdriverProcAddressQueryResult st;
    OK(GPA2("cuLibraryLoadData", &fn, 11080, 0, &st));
    CHECK(fn == NULL && st == CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT, "no library API before 12.0");
    OK(GPA2("cuLibraryLoadData", &fn, 12000, 0, NULL));
    pfn_lload viapa = (pfn_lload)fn;
    CUlibrary a, b, c;
    OK(viapa(&a, "fakemod:629145600", NULL, NULL, 0, NULL, NULL, 0));
    CHECK(FakeModuleBytes() == 600 * MiB, "loaded into the context at once");
    CHECK(used() == 600 * MiB, "600 MiB counted: %llu MiB", (unsigned long long)(used() / MiB));
    CHECK(load(&b, "fakemod:629145600", NULL, NULL, 0, NULL, NULL, 0) == CUDA_ERROR_OUT_OF_MEMORY, "over");
    CHECK(b == NULL && FakeModuleBytes() == 600 * MiB, "refused library unloaded");
    FILE *f = fopen("lib.fatbin", "w");
    CHECK(f && fputs("fakemod:209715200", f) >= 0 && fclose(f) == 0, "write lib.fatbin");
    OK(file(&c, "lib.fatbin", NULL, NULL, 0, NULL, NULL, 0));
    CHECK(used() == 800 * MiB, "cuLibraryLoadFromFile counted");
    OK(unload(a));
    OK(unload(c));
    CHECK(used() == 0 && FakeModuleBytes() == 0, "all back: %llu", (unsigned long long)used());
}

/* In NVML mode the context is NVML's figure for the pid less what the shim
 * counted: a module counted at its load is not counted again as context. */
static void case_modules_nvml(void)
{
    open_driver();
    retain(0);
    CHECK(used() == 300 * MiB, "context measured: %llu", (unsigned long long)(used() / MiB));
    pfn_mload load = (pfn_mload)sym(hcuda, "cuModuleLoadData");
    CUmodule m, n2;
    OK(load(&m, "fakemod:209715200"));
    CHECK(used() == 500 * MiB, "context + module: %llu MiB", (unsigned long long)(used() / MiB));
    CUdeviceptr p;
    OK(Alloc(&p, 400 * MiB)); /* free halves: a refresh from NVML */
    CHECK(used() == 900 * MiB, "not counted twice after a refresh: %llu MiB", (unsigned long long)(used() / MiB));
    CHECK(load(&n2, "fakemod:209715200") == CUDA_ERROR_OUT_OF_MEMORY, "over");
    CHECK(used() == 900 * MiB, "the refused module is not left as context: %llu MiB",
          (unsigned long long)(used() / MiB));
    OK(Free(p));
    OK(load(&n2, "fakemod:209715200"));
    CHECK(FakeDevUsed(0) <= 1 * GiB, "NVML's footprint within the limit");
}

static void case_multidev(void)
{
    /* two GPUs: each has its own region and limit; VMM uses prop's device */
    open_driver();
    CUdeviceptr a, b;
    FakeSetDevice(0);
    OK(Alloc(&a, 900 * MiB));
    FakeSetDevice(1);
    CHECK(used() == 0, "device 1 is a different region");
    OK(Alloc(&b, 900 * MiB));
    CUmemAllocationProp prop = {.type = CU_MEM_ALLOCATION_TYPE_PINNED, .location = {CU_MEM_LOCATION_TYPE_DEVICE, 0}};
    CUmemGenericAllocationHandle h;
    CHECK(Create(&h, 200 * MiB, &prop, 0) == CUDA_ERROR_OUT_OF_MEMORY, "VMM on device 0 (current is 1) is refused");
    prop.location.id = 1;
    CHECK(Create(&h, 200 * MiB, &prop, 0) == CUDA_ERROR_OUT_OF_MEMORY, "device 1 full too");
    OK(Free(a));
    prop.location.id = 0;
    OK(Create(&h, 200 * MiB, &prop, 0));
    FakeSetDevice(0);
    CHECK(used() == 200 * MiB, "counted on device 0");
    FakeSetDevice(-1); /* no context: the driver says why */
    CUdeviceptr c;
    CHECK(Alloc(&c, MiB) != CUDA_ERROR_OUT_OF_MEMORY, "without a context the shim passes the call on");
}

/* ---- footprint: context and driver memory charged to the slice --------- */
static void retain(int dev)
{
    CUcontext c;
    OK(CtxRetain(&c, dev));
}

static void case_footprint_nvml(void)
{
    /* CDMO_SHIM_FOOTPRINT=nvml, a 300 MiB context, limit 1 GiB */
    open_driver();
    retain(0);
    CHECK(FakeDevUsed(0) == 300 * MiB, "the fake's context");
    size_t f, t;
    OK(GetInfo(&f, &t)); /* first use: measured from NVML's figure for our pid */
    CHECK(t == 1 * GiB, "total stays the limit: %zu", t);
    CHECK(f == 724 * MiB, "free falls by the context: %zu", f);
    CUdeviceptr a, b;
    CHECK(Alloc(&a, 800 * MiB) == CUDA_ERROR_OUT_OF_MEMORY, "context + 800 MiB is over 1 GiB");
    unsigned q0 = FakeNvmlQueries();
    for (int i = 0; i < 50; i++) {
        OK(Alloc(&a, 100 * MiB));
        OK(Free(a));
    }
    CHECK(FakeNvmlQueries() == q0, "no NVML query per allocation (%u)", FakeNvmlQueries() - q0);
    /* modules loaded after the measurement: seen once free has halved */
    CHECK(FakeGrowContext(0, 50 * MiB), "grow");
    OK(Alloc(&a, 400 * MiB));
    CHECK(FakeNvmlQueries() == q0 + 1, "free fell below half: one refresh (%u)", FakeNvmlQueries() - q0);
    CHECK(used() == 750 * MiB, "context re-measured at 350 MiB: used %llu MiB", (unsigned long long)(used() / MiB));
    CHECK(Alloc(&b, 300 * MiB) == CUDA_ERROR_OUT_OF_MEMORY, "750 + 300 MiB is over");
    OK(Alloc(&b, 274 * MiB));
    CHECK(FakeDevUsed(0) == 1 * GiB, "the whole footprint, as NVML sees it, is exactly the limit: %llu MiB",
          (unsigned long long)(FakeDevUsed(0) / MiB));
    OK(Free(b));
    OK(Free(a));
    CHECK(used() == 350 * MiB, "the context stays charged: %llu MiB", (unsigned long long)(used() / MiB));
}

/* A limit the context alone fills (FAKE_CTX_BYTES >= the limit): the
 * context stays counted, since the driver holds it, and every allocation is
 * refused; the shim says so once.  One byte more of limit and one byte fits. */
static void case_context_over_limit(void)
{
    uint64_t lim = slice_limit(), ctx = strtoull(getenv("FAKE_CTX_BYTES"), NULL, 10);
    open_driver();
    retain(0);
    CHECK(FakeDevUsed(0) == ctx, "the fake's context");
    size_t f, t;
    OK(GetInfo(&f, &t));
    CHECK(t == lim, "total stays the limit: %zu", t);
    uint64_t room = ctx < lim ? lim - ctx : 0; /* what the slice has left */
    CHECK(f == room, "free is what the context leaves: %zu, want %llu", f, (unsigned long long)room);
    CUdeviceptr p, q;
    for (int i = 0; i < 3; i++) { /* each refusal measures again; said once all the same */
        if (room) {
            OK(Alloc(&p, room));
            CHECK(Alloc(&q, 1) == CUDA_ERROR_OUT_OF_MEMORY, "full after %llu bytes", (unsigned long long)room);
            OK(Free(p));
        } else {
            CHECK(Alloc(&p, 1) == CUDA_ERROR_OUT_OF_MEMORY, "the context fills the limit: 1 byte is refused");
            CHECK(AllocAsync(&p, 2 * MiB, NULL) == CUDA_ERROR_OUT_OF_MEMORY, "stream-ordered too");
        }
    }
    CHECK(FakeDevUsed(0) == ctx, "the refused calls never reached the driver");
    char said[256];
    snprintf(said, sizeof said, "warning: the CUDA context and driver memory of this process on device 0 (%llu bytes) "
             "alone take the whole limit of %llu bytes: every allocation of device memory is refused",
             (unsigned long long)ctx, (unsigned long long)lim);
    CHECK(stderr_count(said) == (room ? 0 : 1), "said %d times, want %d: %s", stderr_count(said), room ? 0 : 1, said);
    CHECK(stderr_count("libgpuslice") == (room ? 0 : 1), "nothing else said");
}

static void case_footprint_lag(void)
{
    /* NVML's per-process figure lagging behind the driver lowers nothing;
     * after a free, a smaller context is believed */
    open_driver();
    retain(0);
    CHECK(used() == 300 * MiB, "context charged");
    FakeNvmlSetLag(100 * MiB);
    CUdeviceptr a, b;
    OK(Alloc(&a, 500 * MiB)); /* crosses half the free space: refresh, with the lag */
    CHECK(used() == 800 * MiB, "a lagging figure does not lower the charge: %llu MiB",
          (unsigned long long)(used() / MiB));
    CHECK(Alloc(&b, 300 * MiB) == CUDA_ERROR_OUT_OF_MEMORY, "800 + 300 MiB is over");
    FakeNvmlSetLag(0);
    OK(Free(a));
    FakeShrinkContext(0, 100 * MiB);
    CHECK(Alloc(&b, 900 * MiB) == CUDA_ERROR_OUT_OF_MEMORY, "200 + 900 MiB is over");
    OK(Alloc(&b, 800 * MiB)); /* the pressure refresh after the free saw 200 MiB */
    CHECK(used() == 1000 * MiB, "used %llu MiB", (unsigned long long)(used() / MiB));
    CHECK(FakeDevUsed(0) <= 1 * GiB, "footprint within the limit");
}

static void case_pool_granule(void)
{
    /* a pool that grows in 64 MiB granules, a limit that is not a multiple
     * of it: 16 MiB allocations until out of memory never take the pool's
     * footprint past the limit */
    open_driver();
    CUdeviceptr p;
    OK(AllocAsync(&p, 16 * MiB, NULL));
    CHECK(used() == 64 * MiB, "the granule is counted as soon as the pool grows: %llu MiB",
          (unsigned long long)(used() / MiB));
    uint64_t got = 16 * MiB;
    while (AllocAsync(&p, 16 * MiB, NULL) == CUDA_SUCCESS) {
        got += 16 * MiB;
        CHECK(FakeDevUsed(0) <= 1000 * MiB, "after %llu MiB: pool footprint %llu MiB over the 1000 MiB limit",
              (unsigned long long)(got / MiB), (unsigned long long)(FakeDevUsed(0) / MiB));
    }
    CHECK(got >= 1000 * MiB - 64 * MiB, "got only %llu MiB", (unsigned long long)(got / MiB));
}

static void case_pool_hidden(void)
{
    /* 8 MiB of driver memory per pool allocation that no pool figure shows:
     * seen only through NVML; the footprint never passes the limit */
    open_driver();
    CUdeviceptr p;
    uint64_t got = 0;
    while (AllocAsync(&p, 16 * MiB, NULL) == CUDA_SUCCESS) {
        got += 16 * MiB;
        CHECK(FakeDevUsed(0) <= 1000 * MiB, "after %llu MiB: footprint %llu MiB over the 1000 MiB limit",
              (unsigned long long)(got / MiB), (unsigned long long)(FakeDevUsed(0) / MiB));
    }
    CHECK(got * 3 / 2 >= 1000 * MiB - 3 * 24 * MiB, "got only %llu MiB", (unsigned long long)(got / MiB));
}

static void case_footprint_delta(void)
{
    /* CDMO_SHIM_FOOTPRINT=delta: the device's used memory around context creation */
    open_driver();
    retain(0);
    CHECK(used() == 300 * MiB, "delta charged: %llu MiB", (unsigned long long)(used() / MiB));
    retain(0); /* already active: nothing new measured */
    CHECK(used() == 300 * MiB, "a second retain changes nothing: %llu MiB", (unsigned long long)(used() / MiB));
    CUdeviceptr a;
    CHECK(Alloc(&a, 800 * MiB) == CUDA_ERROR_OUT_OF_MEMORY, "context + 800 MiB is over 1 GiB");
    OK(Alloc(&a, 700 * MiB));
    CHECK(FakeDevUsed(0) <= 1 * GiB, "footprint within the limit");
}

static void case_footprint_hidden_pid(void)
{
    /* auto, and NVML lists our process under another pid (a container's pid
     * namespace): the context-creation delta is used instead */
    open_driver();
    retain(0);
    CHECK(used() == 300 * MiB, "fallback charged the context: %llu MiB", (unsigned long long)(used() / MiB));
}

static void case_footprint_off(void)
{
    open_driver();
    retain(0);
    CHECK(used() == 0, "CDMO_SHIM_FOOTPRINT=off: no context charge (%llu)", (unsigned long long)used());
}

static void case_footprint_2dev(void)
{
    /* two GPUs, a 200 MiB context on each: one limit per GPU */
    open_driver();
    retain(0);
    retain(1);
    FakeSetDevice(0);
    CHECK(used() == 200 * MiB, "device 0: context charged");
    CUdeviceptr a, b, c;
    OK(Alloc(&a, 800 * MiB));
    FakeSetDevice(1);
    CHECK(used() == 200 * MiB, "device 1 has its own count: %llu MiB", (unsigned long long)(used() / MiB));
    OK(Alloc(&b, 800 * MiB));
    CHECK(Alloc(&c, 100 * MiB) == CUDA_ERROR_OUT_OF_MEMORY, "device 1 full");
    CHECK(FakeDevUsed(0) == 1000 * MiB && FakeDevUsed(1) == 1000 * MiB, "each footprint within its limit");
}

/* ---- pools --------------------------------------------------------------- */
static void case_pool_trim(void)
{
    open_driver();
    CUmemoryPool pool;
    OK(DevGetMemPool(&pool, 0));
    cuuint64_t keep_all = ~0ULL; /* as PyTorch's cudaMallocAsync backend sets it */
    OK(PoolSetAttr(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &keep_all));
    CUdeviceptr a, b, c;
    OK(AllocAsync(&a, 600 * MiB, NULL));
    OK(FreeAsync(a, NULL));
    OK(StreamSync(NULL));
    CHECK(FakeDevUsed(0) == 600 * MiB, "the pool keeps the freed block");
    CHECK(used() == 600 * MiB, "so the slice counts it: %llu MiB", (unsigned long long)(used() / MiB));
    OK(AllocAsync(&b, 200 * MiB, NULL));
    CHECK(used() == 600 * MiB, "served from the pool's kept bytes: %llu MiB", (unsigned long long)(used() / MiB));
    OK(FreeAsync(b, NULL));
    /* fits only once the pool has given its memory back: trim, then retry */
    OK(Alloc(&c, 700 * MiB));
    CHECK(FakeDevUsed(0) == 700 * MiB, "pool trimmed before the retry: %llu MiB",
          (unsigned long long)(FakeDevUsed(0) / MiB));
    CHECK(used() == 700 * MiB, "used %llu MiB", (unsigned long long)(used() / MiB));
    CHECK(Alloc(&a, 400 * MiB) == CUDA_ERROR_OUT_OF_MEMORY, "one retry, then out of memory");
    OK(Free(c));
    CHECK(used() == 0, "all back");
}

static void case_pool_device(void)
{
    /* two GPUs; current device 0; a pool on device 1 */
    open_driver();
    FakeSetDevice(0);
    CUmemPoolProps pp;
    memset(&pp, 0, sizeof pp);
    pp.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    pp.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    pp.location.id = 1;
    CUmemoryPool p1, ph;
    OK(PoolCreate(&p1, &pp));
    CUdeviceptr a, h;
    OK(AllocPool(&a, 600 * MiB, p1, NULL));
    CHECK(used() == 0, "device 0 is not charged: %llu", (unsigned long long)used());
    FakeSetDevice(1);
    CHECK(used() == 600 * MiB, "charged to the pool's device: %llu", (unsigned long long)used());
    CHECK(FakeDevUsed(1) == 600 * MiB, "where the driver put it");
    FakeSetDevice(0);
    CHECK(AllocPool(&a, 500 * MiB, p1, NULL) == CUDA_ERROR_OUT_OF_MEMORY, "device 1's limit applies");
    pp.location.type = CU_MEM_LOCATION_TYPE_HOST;
    pp.location.id = 0;
    OK(PoolCreate(&ph, &pp));
    OK(AllocPool(&h, 2 * GiB, ph, NULL));
    CHECK(used() == 0, "a host pool is not device memory");
    OK(FreeAsync(h, NULL));
    /* the default pool of device 1, named explicitly: device 1 as well */
    CUmemoryPool d1;
    OK(DevGetMemPool(&d1, 1));
    OK(AllocPool(&h, 100 * MiB, d1, NULL));
    FakeSetDevice(1);
    CHECK(used() == 700 * MiB, "default pool of device 1: %llu MiB", (unsigned long long)(used() / MiB));
    OK(FreeAsync(h, NULL));
    FakeSetDevice(0);
    CUdeviceptr a1;
    OK(AllocPool(&a1, 100 * MiB, p1, NULL)); /* reuses p1's kept bytes? no: none kept yet */
    OK(FreeAsync(a1, NULL));
    OK(PoolDestroy(p1)); /* its kept bytes go back now */
    FakeSetDevice(1);
    CHECK(used() == 700 * MiB, "a's 600 MiB still allocated, plus the kept 100 of d1: %llu MiB",
          (unsigned long long)(used() / MiB));
}

/* ---- graphs -------------------------------------------------------------- */
static CUgraphExec alloc_graph(uint64_t bytes, int free_it, CUdeviceptr *dptr)
{
    CUgraph g;
    OK(GraphCreate(&g, 0));
    CUDA_MEM_ALLOC_NODE_PARAMS ap;
    memset(&ap, 0, sizeof ap);
    ap.poolProps.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    ap.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    ap.bytesize = bytes;
    CUgraphNode n1, n2;
    OK(AddAllocNode(&n1, g, NULL, 0, &ap));
    if (free_it) OK(AddFreeNode(&n2, g, &n1, 1, ap.dptr));
    if (dptr) *dptr = ap.dptr;
    CUgraphExec e;
    OK(Instantiate(&e, g, 0));
    return e;
}

static void case_graph_nodes(void)
{
    open_driver();
    CUgraphExec e1 = alloc_graph(300 * MiB, 1, NULL);
    CHECK(used() == 0 && FakeDevUsed(0) == 0, "instantiating commits nothing");
    OK(Launch(e1, NULL));
    CHECK(FakeDevUsed(0) == 300 * MiB, "the graph pool holds it after the launch");
    CHECK(used() == 300 * MiB, "counted at launch, though the graph freed it: %llu MiB",
          (unsigned long long)(used() / MiB));
    OK(Launch(e1, NULL));
    CHECK(used() == 300 * MiB, "a relaunch is served by the graph pool");
    /* pressure during a launch trims the graph pool, whose spare then no
     * longer serves the graph: what it needs is counted again */
    CUdeviceptr q;
    OK(Alloc(&q, 500 * MiB));
    CUgraphExec e4 = alloc_graph(600 * MiB, 1, NULL);
    CHECK(Launch(e4, NULL) == CUDA_ERROR_OUT_OF_MEMORY, "500 MiB + a 600 MiB graph is over the limit");
    CHECK(FakeDevUsed(0) == 500 * MiB, "the spare was trimmed and nothing mapped: %llu MiB",
          (unsigned long long)(FakeDevUsed(0) / MiB));
    OK(Free(q));
    CUdeviceptr kept;
    CUgraphExec e2 = alloc_graph(900 * MiB, 0, &kept);
    OK(Launch(e2, NULL));
    CHECK(used() == 900 * MiB && FakeDevUsed(0) == 900 * MiB, "used %llu MiB", (unsigned long long)(used() / MiB));
    CUdeviceptr p;
    CHECK(Alloc(&p, 200 * MiB) == CUDA_ERROR_OUT_OF_MEMORY, "graph memory in use counts");
    OK(Free(kept)); /* freed outside the graph: back to the graph pool */
    OK(Alloc(&p, 200 * MiB)); /* fits once pressure has trimmed the graph pool */
    CHECK(FakeDevUsed(0) == 200 * MiB && used() == 200 * MiB, "graph pool trimmed: %llu MiB",
          (unsigned long long)(used() / MiB));
    CUgraphExec e3 = alloc_graph(900 * MiB, 1, NULL);
    CHECK(Launch(e3, NULL) == CUDA_ERROR_OUT_OF_MEMORY, "a graph that does not fit is refused at launch");
    CHECK(FakeDevUsed(0) == 200 * MiB, "and the driver mapped nothing");
    OK(Free(p));
    OK(Launch(e3, NULL));
    CHECK(used() == 900 * MiB, "used %llu MiB", (unsigned long long)(used() / MiB));
    OK(ExecDestroy(e3));
    OK(GraphMemTrim(0));
    CHECK(used() == 0 && FakeDevUsed(0) == 0, "trimmed: %llu", (unsigned long long)used());
    OK(ExecDestroy(e1));
    OK(ExecDestroy(e2));
    OK(ExecDestroy(e4));
}

static void case_graph_capture(void)
{
    open_driver();
    CUstream s = (CUstream)(uintptr_t)0x5;
    CUdeviceptr cp, p;
    CUgraph g;
    OK(BeginCapture(s, 2));
    OK(AllocAsync(&cp, 500 * MiB, s)); /* the shim cannot tell: counted for now */
    OK(EndCapture(s, &g));
    CHECK(FakeDevUsed(0) == 0, "capturing commits nothing");
    CUgraphExec e;
    OK(Instantiate(&e, g, 0)); /* a graph allocation now: leaves the stream-ordered count */
    OK(Alloc(&p, 1 * GiB));
    OK(Free(p));
    CHECK(used() == 0, "nothing left of the capture: %llu", (unsigned long long)used());
    OK(Launch(e, s));
    CHECK(used() == 500 * MiB && FakeDevUsed(0) == 500 * MiB, "counted at launch: %llu MiB",
          (unsigned long long)(used() / MiB));
    CHECK(Alloc(&p, 600 * MiB) == CUDA_ERROR_OUT_OF_MEMORY, "the graph's memory counts");
    OK(Free(cp)); /* the graph allocation, freed outside the graph */
    OK(GraphMemTrim(0));
    CHECK(used() == 0, "released with the graph pool: %llu", (unsigned long long)used());
}

/* ====================================================================== */
struct tcase { const char *name; void (*fn)(void); const char *env; };
static const struct tcase cases[] = {
    {"passthrough", case_passthrough, ""},
    {"disable_no_limit", case_passthrough, "CDMO_SHIM_DISABLE=1"},
    {"disable_ignored", case_disable_ignored, "LIMIT_FILE=1073741824 CDMO_SHIM_DISABLE=1"},
    {"limit_exact", case_limit_exact, "LIMIT_FILE=1073741824"},
    {"limit_bare", case_limit_exact, "LIMIT_FILE_BARE=1073741824"},
    /* the variable is for display: raised, garbage or absent, the file's limit holds */
    {"limit_env_raised", case_limit_exact, "LIMIT_FILE=1073741824 CDMO_GPU_MEMORY_LIMIT=85899345920"},
    {"limit_env_garbage", case_limit_exact, "LIMIT_FILE=1073741824 CDMO_GPU_MEMORY_LIMIT=abc"},
    {"limit_env_only", case_refused_no_file, "CDMO_GPU_MEMORY_LIMIT=85899345920"},
    {"limit_file_dir", case_refused_unreadable, "SHIMTEST_LIMIT_DIR=1 CDMO_GPU_MEMORY_LIMIT=85899345920"},
    {"limit_zero", case_refused, "LIMIT_FILE=0"},
    {"limit_zeros", case_refused, "LIMIT_FILE=000"},
    {"limit_abc", case_refused, "LIMIT_FILE=abc"},
    {"limit_negative", case_refused, "LIMIT_FILE=-5"},
    {"limit_empty", case_refused, "LIMIT_FILE="},
    {"limit_empty_file", case_refused, "LIMIT_FILE_BARE="},
    {"limit_two_lines", case_refused, "LIMIT_FILE=1073741824\\n"},
    {"limit_long", case_refused, "LIMIT_FILE=000000000000000000000000000001073741824"},
    {"limit_2pow64", case_refused, "LIMIT_FILE=18446744073709551616"},
    {"limit_trailing", case_refused, "LIMIT_FILE=12abc"},
    {"limit_unit", case_refused, "LIMIT_FILE=4Gi"},
    {"limit_zero_context", case_refused,
     "LIMIT_FILE=0 CDMO_SHIM_FOOTPRINT=nvml FAKE_CTX_BYTES=314572800"},
    /* 1(c): a 300 MiB context, limits of 256 MiB, exactly 300 MiB, 300 MiB + 1 byte */
    {"context_over_limit", case_context_over_limit,
     "LIMIT_FILE=268435456 CDMO_SHIM_FOOTPRINT=nvml FAKE_CTX_BYTES=314572800"},
    {"context_over_limit_delta", case_context_over_limit,
     "LIMIT_FILE=268435456 CDMO_SHIM_FOOTPRINT=delta FAKE_CTX_BYTES=314572800"},
    {"context_at_limit", case_context_over_limit,
     "LIMIT_FILE=314572800 CDMO_SHIM_FOOTPRINT=nvml FAKE_CTX_BYTES=314572800"},
    {"context_below_limit", case_context_over_limit,
     "LIMIT_FILE=314572801 CDMO_SHIM_FOOTPRINT=nvml FAKE_CTX_BYTES=314572800"},
    {"dlsym", case_dlsym, "LIMIT_FILE=1073741824"},
    {"procaddr", case_procaddr, "LIMIT_FILE=1073741824"},
    {"procaddr_internal", case_procaddr, "LIMIT_FILE=1073741824 FAKE_PROCADDR_INTERNAL=1"},
    {"accounting", case_accounting, "LIMIT_FILE=1073741824"},
    {"kinds", case_kinds, "LIMIT_FILE=1073741824"},
    {"rollback", case_rollback, "LIMIT_FILE=1073741824 FAKE_TOTAL=268435456"},
    {"nvml", case_nvml, "LIMIT_FILE=2147483648"},
    {"nvml_full_gpu", case_nvml, "LIMIT_FILE=2147483648 FAKE_NVML_USED=84825604096"},
    {"race2", case_race2, "LIMIT_FILE=1073741824"},
    {"race16", case_race16, "LIMIT_FILE=1073741824"},
    {"sigkill", case_sigkill, "LIMIT_FILE=1073741824"},
    {"stale_report", case_stale_report, "LIMIT_FILE=1073741824"},
    {"fork", case_fork, "LIMIT_FILE=1073741824"},
    {"exec", case_exec, "LIMIT_FILE=1073741824"},
    {"threads", case_threads, "LIMIT_FILE=1073741824"},
    {"many", case_many, "LIMIT_FILE=1073741824000"},
    {"region_file", case_region_file, "LIMIT_FILE=1073741824 CDMO_SLICE=team-a/train-1"},
    {"closed", case_closed, "LIMIT_FILE=1073741824 FAKE_NDEV=2 SHIMTEST_NO_LEDGER=1"},
    {"ledger_fixed", case_ledger_fixed, "LIMIT_FILE=1073741824"},
    {"stale_boot", case_stale_boot, "LIMIT_FILE=1073741824"},
    {"refusal_count", case_refusal_count, "LIMIT_FILE=1073741824"},
    {"modules", case_modules, "LIMIT_FILE=1073741824"},
    {"modules_internal", case_modules, "LIMIT_FILE=1073741824 FAKE_PROCADDR_INTERNAL=1"},
    {"modules_nvml", case_modules_nvml,
     "LIMIT_FILE=1073741824 CDMO_SHIM_FOOTPRINT=nvml FAKE_CTX_BYTES=314572800"},
    {"libraries", case_libraries, "LIMIT_FILE=1073741824"},
    {"multidev", case_multidev, "LIMIT_FILE=1073741824 FAKE_NDEV=2"},
    {"footprint_nvml", case_footprint_nvml,
     "LIMIT_FILE=1073741824 CDMO_SHIM_FOOTPRINT=nvml FAKE_CTX_BYTES=314572800"},
    {"footprint_delta", case_footprint_delta,
     "LIMIT_FILE=1073741824 CDMO_SHIM_FOOTPRINT=delta FAKE_CTX_BYTES=314572800"},
    {"footprint_hidden_pid", case_footprint_hidden_pid,
     "LIMIT_FILE=1073741824 FAKE_NVML_PID_OFFSET=1000000 FAKE_CTX_BYTES=314572800"},
    {"footprint_off", case_footprint_off,
     "LIMIT_FILE=1073741824 CDMO_SHIM_FOOTPRINT=off FAKE_CTX_BYTES=314572800"},
    {"footprint_2dev", case_footprint_2dev,
     "LIMIT_FILE=1073741824 CDMO_SHIM_FOOTPRINT=nvml FAKE_NDEV=2 FAKE_CTX_BYTES=209715200"},
    {"footprint_lag", case_footprint_lag,
     "LIMIT_FILE=1073741824 CDMO_SHIM_FOOTPRINT=nvml FAKE_CTX_BYTES=314572800"},
    {"pool_trim", case_pool_trim, "LIMIT_FILE=1073741824"},
    {"pool_granule", case_pool_granule, "LIMIT_FILE=1048576000 FAKE_POOL_GRANULE=67108864"},
    /* 8 MiB of driver memory per pool allocation that no pool figure shows */
    {"pool_hidden", case_pool_hidden,
     "LIMIT_FILE=1048576000 FAKE_POOL_HIDDEN=8388608 CDMO_SHIM_FOOTPRINT=nvml"},
    {"pool_device", case_pool_device, "LIMIT_FILE=1073741824 FAKE_NDEV=2"},
    {"graph_nodes", case_graph_nodes, "LIMIT_FILE=1073741824"},
    {"graph_capture", case_graph_capture, "LIMIT_FILE=1073741824"},
};
#define NCASES (sizeof cases / sizeof *cases)

static char here[PATH_MAX];

static void rmtree(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *e;
    char p[PATH_MAX];
    while ((e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) {
            snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
            if (unlink(p) != 0 && errno == EISDIR) rmtree(p);
        }
    closedir(d);
    rmdir(dir);
}

/* run one case in a child with its environment; returns 1 if it passed */
static int run_case(const struct tcase *c)
{
    char dir[] = "/tmp/shimtest.XXXXXX";
    if (!mkdtemp(dir)) return 0;
    pid_t pid = fork();
    if (pid == 0) {
        char buf[PATH_MAX * 2];
        snprintf(buf, sizeof buf, "%s/build/test/libgpuslice.so", here);
        setenv("LD_PRELOAD", buf, 1);
        const char *old = getenv("LD_LIBRARY_PATH");
        snprintf(buf, sizeof buf, "%s/build/fake%s%s", here, old ? ":" : "", old ? old : "");
        setenv("LD_LIBRARY_PATH", buf, 1);
        setenv("SHIMTEST_DIR", dir, 1);
        setenv("CDMO_SLICE", "test/shimtest", 1);
        unsetenv("CDMO_GPU_MEMORY_LIMIT");
        unsetenv("CDMO_SHIM_DISABLE");
        unsetenv("CDMO_SHIM_FOOTPRINT");
        unsetenv("SHIMTEST_NO_LEDGER");
        unsetenv("SHIMTEST_STAGE");
        char env[512];
        snprintf(env, sizeof env, "%s", c->env);
        if (chdir(dir) != 0) _exit(125);
        for (char *tok = strtok(env, " "); tok; tok = strtok(NULL, " ")) {
            char *eq = strchr(tok, '=');
            *eq = 0;
            int bare = !strcmp(tok, "LIMIT_FILE_BARE");
            if (bare || !strcmp(tok, "LIMIT_FILE")) { /* the mounted file, not a variable */
                FILE *lf = fopen("limit", "w");
                if (!lf) _exit(123);
                for (const char *v = eq + 1; *v; v++) /* \n in a case's word: a newline */
                    if (v[0] == '\\' && v[1] == 'n') fputc('\n', lf), v++;
                    else fputc(*v, lf);
                if (!bare) fputc('\n', lf);
                if (fclose(lf) != 0) _exit(123);
            } else if (!strcmp(tok, "SHIMTEST_LIMIT_DIR")) {
                if (mkdir("limit", 0755) != 0) _exit(123);
            } else {
                setenv(tok, eq + 1, 1);
            }
        }
        char self[PATH_MAX];
        ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
        if (n <= 0) _exit(127);
        self[n] = 0;
        if (!getenv("SHIMTEST_NO_LEDGER") && mkdir("ledger", 01777) != 0) _exit(124);
        snprintf(buf, sizeof buf, "%s/stderr", dir);
        int efd = open(buf, O_WRONLY | O_CREAT | O_TRUNC | O_APPEND, 0600);
        if (efd < 0 || dup2(efd, 2) < 0) _exit(126);
        close(efd);
        alarm(120);
        execl(self, self, "--case", c->name, (char *)NULL);
        _exit(127);
    }
    int st = 0;
    waitpid(pid, &st, 0);
    char path[PATH_MAX + 16];
    snprintf(path, sizeof path, "%s/stderr", dir);
    FILE *ef = fopen(path, "r");
    if (ef) { /* what the case said, for whoever reads our output */
        char line[1024];
        while (fgets(line, sizeof line, ef)) fputs(line, stderr);
        fclose(ef);
    }
    rmtree(dir);
    if (WIFSIGNALED(st)) fprintf(stderr, "  [%s] killed by signal %d\n", c->name, WTERMSIG(st));
    return WIFEXITED(st) && WEXITSTATUS(st) == 0;
}

int main(int argc, char **argv)
{
    if (argc == 3 && !strcmp(argv[1], "--case")) {
        for (size_t i = 0; i < NCASES; i++)
            if (!strcmp(cases[i].name, argv[2])) {
                g_case = cases[i].name;
                cases[i].fn();
                return 0;
            }
        return 2;
    }
    /* the shim and the fakes live next to build/: find them from our path */
    char self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) return 2;
    self[n] = 0;
    *strrchr(self, '/') = 0;                           /* .../shim/build */
    snprintf(here, sizeof here, "%s", self);
    *strrchr(here, '/') = 0;                           /* .../shim */
    if (argc == 2 && !strcmp(argv[1], "--list")) {
        for (size_t i = 0; i < NCASES; i++) puts(cases[i].name);
        return 0;
    }
    int failed = 0, ran = 0;
    printf("1..%zu\n", argc == 3 ? (size_t)1 : NCASES);
    for (size_t i = 0; i < NCASES; i++) {
        if (argc == 3 && !strcmp(argv[1], "--run") && strcmp(argv[2], cases[i].name)) continue;
        int ok = run_case(&cases[i]);
        ran++;
        printf("%sok %d - %s\n", ok ? "" : "not ", ran, cases[i].name);
        fflush(stdout);
        failed += !ok;
    }
    if (!ran) {
        fprintf(stderr, "no such case\n");
        return 2;
    }
    printf("# %d passed, %d failed\n", ran - failed, failed);
    return failed ? 1 : 0;
}
