// groups.h: the table of oxccl groups that the inference ops (inference.cpp) reach by a small
// integer handle. Every C++ backend (backend.cpp) registers its communicator here when it is
// made and removes it when it goes; an op holds a reference to the group for the length of
// its call, so a group destroyed meanwhile keeps its communicator until the call returns.
#ifndef OXCCL_TORCH_GROUPS_H
#define OXCCL_TORCH_GROUPS_H

#include <cstdint>
#include <memory>
#include <string>

#include "oxccl.h"

namespace oxccl_torch {

// One communicator: the library's table and a handle this object owns (destroyed with it).
struct Group {
  Group(const oxcclApi_t* api, oxcclComm_t comm, int rank, int size) : api(api), comm(comm), rank(rank), size(size) {}
  ~Group() { api->comm_destroy(comm); }
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

  const oxcclApi_t* api;
  oxcclComm_t comm;
  int rank;
  int size;
};

// Registers `g` and returns its handle (>= 1; handles are not reused in a process).
int64_t registerGroup(std::shared_ptr<Group> g);
// Removes the handle's group from the table (its calls in flight finish).
void unregisterGroup(int64_t handle);
// The group of `handle`, or null when there is none (never registered, or destroyed).
std::shared_ptr<Group> findGroup(int64_t handle);

// Raises the oxccl exception class of `r` (oxccl._errors) with `msg` (backend.cpp).
[[noreturn]] void raise(oxcclResult_t r, const std::string& msg);

}  // namespace oxccl_torch

#endif  // OXCCL_TORCH_GROUPS_H
