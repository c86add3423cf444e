# NCCL: prefer the copy that LibTorch itself loads (the pip wheel's nvidia/nccl, beside torch/), so that one
# libnccl.so.2 serves both; fall back to the CUDA toolkit's or the system's.
# Defines NCCL_FOUND and the imported target NCCL::nccl.
set(_smp_nccl_hints)
if(Torch_DIR)
  # Torch_DIR is <site-packages>/torch/share/cmake/Torch
  get_filename_component(_smp_site_packages "${Torch_DIR}/../../../.." ABSOLUTE)
  list(APPEND _smp_nccl_hints "${_smp_site_packages}/nvidia/nccl")
endif()
list(APPEND _smp_nccl_hints ${NCCL_ROOT} $ENV{NCCL_ROOT} /usr/local/cuda /usr)

find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${_smp_nccl_hints} PATH_SUFFIXES include NO_DEFAULT_PATH)
find_path(NCCL_INCLUDE_DIR nccl.h)
find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2 NAMES_PER_DIR HINTS ${_smp_nccl_hints} PATH_SUFFIXES lib lib64
             NO_DEFAULT_PATH)
find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2)

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(NCCL REQUIRED_VARS NCCL_LIBRARY NCCL_INCLUDE_DIR)
if(NCCL_FOUND AND NOT TARGET NCCL::nccl)
  add_library(NCCL::nccl UNKNOWN IMPORTED)
  set_target_properties(NCCL::nccl PROPERTIES IMPORTED_LOCATION "${NCCL_LIBRARY}"
                        INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
endif()
