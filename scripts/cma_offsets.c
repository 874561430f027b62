/* The kernel's cross-process copy by relative page offset: a 2 MiB process_vm_writev (to this
 * process itself, in 256 KiB calls, as the single-copy path copies chunks), best of N runs, for
 * each (dst - src) mod 4096 in the first column and a few absolute source offsets.
 *
 *   cc -O2 -o target/cma_offsets scripts/cma_offsets.c && target/cma_offsets 10
 *
 * On the development machine (AMD EPYC VM, kernel 6.18) rows 8, 16 and 24 took 1.0-1.6 ms and
 * every other row 0.25-0.35 ms: see crates/oxccl/src/direct/cma/placement.rs. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>
#include <time.h>
#include <sys/mman.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc,char**argv){
  size_t chunk=256<<10, total=2<<20; int reps=argc>1?atoi(argv[1]):10;
  char*a=mmap(0,total+16384,PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_ANONYMOUS,-1,0);
  char*b=mmap(0,total+16384,PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_ANONYMOUS,-1,0);
  memset(a,1,total+16384); memset(b,2,total+16384);
  pid_t me=getpid();
  int srcs[]={0,16,64,2000}; int diffs[]={0,8,16,24,32,40,48,56,64,72,80,96,128,136,512,528,1024,1040,2048,2064,4032,4048,4064,4080,4088};
  int nd=sizeof diffs/sizeof *diffs;
  printf("writev us (2 MiB), rows (dst-src) mod 4096, cols src page offset:");
  for(int j=0;j<4;j++)
    printf(" %6d",srcs[j]);
  printf("\n");
  for(int i=0;i<nd;i++){ printf("%5d: ",diffs[i]);
    for(int j=0;j<4;j++){ int s=srcs[j], d=(s+diffs[i])%4096; double best=1e9;
      for(int r=0;r<reps;r++){ double t0=now();
        for(size_t off=0;off<total;off+=chunk){ struct iovec l={a+s+off,chunk}, rr={b+d+off,chunk}; process_vm_writev(me,&l,1,&rr,1,0);}
        double t=now()-t0; if(t<best)best=t;}
      printf(" %6.0f",best*1e6);
    }
    printf("\n");
  }
}
