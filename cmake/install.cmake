# What `cmake --install` puts under a prefix, for C++ programs outside this tree:
#   include/smp/...            the public headers of every layer
#   lib/libsmp_*.a             the static libraries
#   lib/cmake/smp/             smpConfig.cmake: find_package(smp) gives smp::smp (and smp::engine, smp::scheduler, ...)
#   bin/                       smprun, smp_checkpoint, smp_schedule
# The libraries are static and were compiled against one LibTorch: smpConfig.cmake finds Torch again (the same
# wheel's, through CMAKE_PREFIX_PATH or the python3 holding it) and the other dependencies the static libraries link.
# A pip install (scikit-build-core, pyproject.toml) installs the "python" component alone: the package and its
# tools (smprun, smp_checkpoint, smp_schedule, smp_plan).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(SMP_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/smp)

add_library(smp INTERFACE)
target_link_libraries(smp INTERFACE smp_engine)

set(smp_exported smp smp_engine smp_core smp_comm smp_partitioner smp_scheduler smp_torch)
foreach(target ${smp_exported})
  string(REGEX REPLACE "^smp_" "" exported_name ${target})
  set_target_properties(${target} PROPERTIES EXPORT_NAME ${exported_name})
endforeach()

install(TARGETS ${smp_exported} EXPORT smpTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT development
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
foreach(layer scheduler partitioner comm engine)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/${layer}/include/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
          COMPONENT development)
endforeach()
install(TARGETS smprun smp_checkpoint smp_schedule RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT development)
install(EXPORT smpTargets NAMESPACE smp:: DESTINATION ${SMP_CMAKE_DIR} COMPONENT development)
install(FILES ${PROJECT_SOURCE_DIR}/third_party/cmake/FindMETIS.cmake ${PROJECT_SOURCE_DIR}/third_party/cmake/FindNCCL.cmake
        DESTINATION ${SMP_CMAKE_DIR} COMPONENT development)

# Where smpConfig.cmake looks for the python3 holding the torch wheel when not told.
get_filename_component(SMP_BUILD_PYTHON_EXECUTABLE_DIR "${Python3_EXECUTABLE}" DIRECTORY)
configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/smpConfig.cmake.in ${CMAKE_BINARY_DIR}/smpConfig.cmake
                              INSTALL_DESTINATION ${SMP_CMAKE_DIR})
write_basic_package_version_file(${CMAKE_BINARY_DIR}/smpConfigVersion.cmake COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_BINARY_DIR}/smpConfig.cmake ${CMAKE_BINARY_DIR}/smpConfigVersion.cmake
        DESTINATION ${SMP_CMAKE_DIR} COMPONENT development)
