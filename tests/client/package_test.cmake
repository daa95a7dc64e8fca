# cmake -DQTX_BUILD_DIR=... -DWORK_DIR=... -DCONSUMER_DIR=... -DGENERATOR=... -P package_test.cmake
# Installs the qtx build into WORK_DIR/prefix, then configures, builds and runs
# the consumer project with find_package(qtx).
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
  set(LAST_OUTPUT "${out}" PARENT_SCOPE)
endfunction()

file(REMOVE_RECURSE ${WORK_DIR})
set(prefix ${WORK_DIR}/prefix)
run(${CMAKE_COMMAND} --install ${QTX_BUILD_DIR} --prefix ${prefix})
foreach(f include/qtx/client.h include/qtx/collective_types.h include/qtx/shm_region.h
          include/qtx/types.h
          include/qtx/v1/quantizer.pb.h include/qtx/v1/memory.grpc.pb.h
          lib/cmake/qtx/qtxConfig.cmake share/qtx/proto/qtx/v1/tensor.proto)
  if(NOT EXISTS ${prefix}/${f})
    message(FATAL_ERROR "not installed: ${f}")
  endif()
endforeach()
# The client must not drag server or kernel code into the package.
file(GLOB leaked ${prefix}/include/kernels ${prefix}/include/server)
if(leaked)
  message(FATAL_ERROR "installed headers outside the client's API: ${leaked}")
endif()
run(${CMAKE_COMMAND} -S ${CONSUMER_DIR} -B ${WORK_DIR}/build -G ${GENERATOR}
    -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_BUILD_TYPE=Release)
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build -j2)
run(${WORK_DIR}/build/consumer)
if(NOT LAST_OUTPUT MATCHES "consumer ok")
  message(FATAL_ERROR "consumer printed: ${LAST_OUTPUT}")
endif()
message(STATUS "package test passed")
