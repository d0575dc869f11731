// What the stand-in cuBLAS and NCCL call in the stand-in libcuda (fake_driver.hpp's
// tpc_fake_* functions): looked up in the libcuda this process already loaded, null when
// that is not the stand-in.
#pragma once

#include <dlfcn.h>

template <class F>
F fake_driver_hook(const char* name) {
    void* driver = dlopen("libcuda.so", RTLD_NOW | RTLD_NOLOAD);
    return driver ? reinterpret_cast<F>(dlsym(driver, name)) : nullptr;
}
