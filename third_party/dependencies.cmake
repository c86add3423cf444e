# Glue for external packages; nothing here is copied source. Included (not add_subdirectory) from the top level
# so that the imported targets are visible everywhere.

find_package(Threads REQUIRED)
find_package(nlohmann_json 3.10 REQUIRED)
find_package(spdlog REQUIRED)
find_package(METIS REQUIRED)
find_package(ZLIB REQUIRED)
find_package(GlooHeaders REQUIRED)

# LibTorch comes from the pip `torch` wheel; scripts/setup.sh passes its torch.utils.cmake_prefix_path. A build
# that is not told (pip install, a user's own cmake) asks the Python that holds the wheel: Python3_EXECUTABLE, or
# the python3 on PATH (a virtual environment's when it is active).
if(NOT Torch_DIR AND NOT CMAKE_PREFIX_PATH MATCHES "torch")
  find_program(SMP_TORCH_PYTHON NAMES python3 python HINTS "$ENV{VIRTUAL_ENV}/bin" ENV PATH)
  if(Python3_EXECUTABLE)
    set(SMP_TORCH_PYTHON "${Python3_EXECUTABLE}")
  endif()
  if(SMP_TORCH_PYTHON)
    execute_process(COMMAND "${SMP_TORCH_PYTHON}" -c "import torch.utils; print(torch.utils.cmake_prefix_path)"
                    OUTPUT_VARIABLE smp_torch_prefix OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    if(smp_torch_prefix)
      list(APPEND CMAKE_PREFIX_PATH "${smp_torch_prefix}")
    endif()
  endif()
endif()
find_package(Torch REQUIRED)
# TORCH_LIBRARIES carries the wheel's compile flags and definitions (USE_C10D_GLOO among them).
add_library(smp_torch INTERFACE)
add_library(smp::torch ALIAS smp_torch)
target_link_libraries(smp_torch INTERFACE ${TORCH_LIBRARIES})

# The NCCL path is compiled whenever LibTorch was built with CUDA and NCCL is found: both are on the build
# machines, GPU or not, so CI compiles and links it. Without them comm/ builds a stand-in that says why.
find_package(NCCL)
set(SMP_WITH_NCCL OFF)
if(NCCL_FOUND AND TARGET c10_cuda)
  set(SMP_WITH_NCCL ON)
endif()
message(STATUS "smp: NCCL path: ${SMP_WITH_NCCL} (${NCCL_LIBRARY})")
