/* A stand-in for the NVIDIA driver's libnvidia-ml.so.1 on a machine without a GPU.
 *
 * fbgemm-gpu's CUDA build links against NVML and does not import without it. Each
 * function fbgemm references (nm -D --undefined-only fbgemm_gpu/*.so | grep nvml)
 * answers NVML_ERROR_DRIVER_NOT_LOADED (9), so nothing can mistake this for a GPU.
 * Used by `make cuda-check` only; never installed into a user's environment. */
#define NVML_ERROR_DRIVER_NOT_LOADED 9

int nvmlInit_v2(void) { return NVML_ERROR_DRIVER_NOT_LOADED; }
int nvmlDeviceGetCount_v2(unsigned int* count) {
  if (count) *count = 0;
  return NVML_ERROR_DRIVER_NOT_LOADED;
}
int nvmlDeviceGetHandleByIndex_v2(unsigned int index, void** device) { return NVML_ERROR_DRIVER_NOT_LOADED; }
int nvmlDeviceGetPciInfo_v3(void* device, void* pci) { return NVML_ERROR_DRIVER_NOT_LOADED; }
int nvmlDeviceGetNvLinkState(void* device, unsigned int link, int* active) { return NVML_ERROR_DRIVER_NOT_LOADED; }
int nvmlDeviceGetNvLinkRemotePciInfo_v2(void* device, unsigned int link, void* pci) {
  return NVML_ERROR_DRIVER_NOT_LOADED;
}
