/*-------------------------------------------------------------------------
 *
 * ownership.h
 *	  Which relations are ours, and acting as the extension's owner
 *	  (ownership.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_COMMON_OWNERSHIP_H
#define IDEM_COMMON_OWNERSHIP_H

typedef struct IdemAsOwner
{
	Oid			save_userid;
	int			save_sec_context;
	int			nestlevel;
} IdemAsOwner;

extern Oid	idem_extension_owner(void);
extern const char *idem_relation_distrust(Oid relid, Oid parent);
extern void idem_check_members_owned(void);
extern void idem_become_owner(IdemAsOwner *as);
extern void idem_unbecome_owner(IdemAsOwner *as);
extern void idem_spi_connect_as_owner(IdemAsOwner *as);
extern void idem_spi_finish_as_owner(IdemAsOwner *as);

#endif							/* IDEM_COMMON_OWNERSHIP_H */
